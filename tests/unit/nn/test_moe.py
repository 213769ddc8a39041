"""The MoE block, its dispatch paths, and its load-balancing statistics.

transformers 4.57 (this environment's pin) has the same
``load_balancing_loss_func`` as the 5.x Qwen3.5-MoE reference, so the aux
loss is checked against it in-process; ``tests/integration/moe`` checks it
against 5.24 itself.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor
from transformers.models.qwen3_next.modeling_qwen3_next import load_balancing_loss_func

from fairseq2.error import NotSupportedError
from fairseq2.models.transformer import GLUFeedForwardNetwork
from fairseq2.models.transformer_lm import apply_ac_to_transformer_lm
from fairseq2.nn import BatchLayout, Linear

from qwen35_fs2.nn import collect_moe_statistics
from qwen35_fs2.models.qwen35_moe import create_qwen35_moe_model
from qwen35_fs2.nn.moe.experts import ExpertDispatch, RoutedExperts
from qwen35_fs2.nn.moe.block import Qwen35MoeBlock
from qwen35_fs2.nn.moe.router import TopKRouter
from qwen35_fs2.nn.moe.statistics import MoeStatistics, MoeStatisticsRecorder
from qwen35_fs2.models.qwen35_moe.config import tiny_qwen35_moe_config
from qwen35_fs2.parallel.ac import apply_ac_to_qwen35

MODEL_DIM = 16


def _normal(param: Tensor) -> None:
    torch.nn.init.normal_(param, std=0.3)


def _make_block(
    num_experts: int = 6,
    top_k: int = 2,
    inner_dim: int = 8,
    *,
    normalize_top_k: bool = True,
    dispatch: ExpertDispatch = "auto",
    seed: int = 0,
) -> Qwen35MoeBlock:
    torch.manual_seed(seed)

    def init_linear(proj: Linear) -> None:
        _normal(proj.weight)

    return Qwen35MoeBlock(
        TopKRouter(MODEL_DIM, num_experts, top_k, normalize_top_k=normalize_top_k, init_fn=_normal),
        RoutedExperts(num_experts, MODEL_DIM, inner_dim, dispatch=dispatch, init_fn=_normal),
        GLUFeedForwardNetwork(MODEL_DIM, 12, bias=False, inner_dim_scale=1.0, proj_init_fn=init_linear),
        Linear(MODEL_DIM, 1, bias=False, init_fn=init_linear),
    )


def _naive_moe(block: Qwen35MoeBlock, seqs: Tensor) -> Tensor:
    """Token by token, expert by expert: the MoE formula written out."""
    experts = block.experts

    x = seqs.reshape(-1, MODEL_DIM)

    probs = F.linear(x, block.router.weight).softmax(dim=-1)

    outputs = []

    for token_idx in range(x.size(0)):
        weights, indices = probs[token_idx].topk(block.router.top_k)

        if block.router.normalize_top_k:
            weights = weights / weights.sum()

        token = x[token_idx]

        y = torch.zeros_like(token)

        for weight, expert_idx in zip(weights, indices.tolist()):
            gate, inner = (experts.gate_inner_proj[expert_idx] @ token).chunk(2)

            y = y + weight * (experts.output_proj[expert_idx] @ (F.silu(gate) * inner))

        shared = torch.sigmoid(block.shared_expert_gate(token)) * block.shared_expert(token)

        outputs.append(y + shared)

    return torch.stack(outputs).view(seqs.shape)


def _grads_of_experts_one_by_one(
    experts: RoutedExperts, seqs: Tensor, group_sizes: list[int], cotangent: Tensor
) -> dict[str, Tensor]:
    """The output ("output") of ``experts`` on ``seqs`` sorted by expert,
    and the gradients of ``seqs`` ("seqs") and of the stacked weights, from
    autograd over one SwiGLU expert at a time."""
    seqs = seqs.clone().requires_grad_()

    gate_inner_proj = experts.gate_inner_proj.detach().clone().requires_grad_()
    output_proj = experts.output_proj.detach().clone().requires_grad_()

    outputs = []

    for expert_idx, rows in enumerate(seqs.split(group_sizes)):
        gate, inner = (rows @ gate_inner_proj[expert_idx].t()).chunk(2, dim=-1)

        outputs.append((F.silu(gate) * inner) @ output_proj[expert_idx].t())

    output = torch.cat(outputs)

    torch.autograd.backward((output * cotangent).sum())

    return {
        "output": output.detach(),
        "seqs": seqs.grad,
        "gate_inner_proj": gate_inner_proj.grad,
        "output_proj": output_proj.grad,
    }


def _grads(module: torch.nn.Module) -> dict[str, Tensor]:
    # Without the prefix that activation-checkpoint wrappers add.
    return {
        name.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
        for name, p in module.named_parameters()
        if p.grad is not None
    }


class TestTopKRouter:
    def test_raises_error_when_top_k_exceeds_num_experts(self) -> None:
        with pytest.raises(ValueError, match=r"`top_k` must be between 1 and `num_experts` \(4\), but is 5 instead\."):
            TopKRouter(MODEL_DIM, 4, 5)

    def test_raises_error_for_an_unknown_precision(self) -> None:
        with pytest.raises(ValueError, match=r"`precision` must be 'activation' or 'fp32', but is 'bf16' instead\."):
            TopKRouter(MODEL_DIM, 4, 2, precision="bf16")  # type: ignore[arg-type]

    @pytest.mark.parametrize("bf16_weights", [False, True], ids=["autocast", "bf16-weights"])
    def test_activation_precision_routes_as_transformers(self, bf16_weights: bool) -> None:
        """Under bf16 autocast, or with bf16 weights and activations, the
        default routes as transformers' Qwen3.5-MoE router: the logits of
        ``F.linear(hidden_states, weight)`` in the activation dtype, an fp32
        softmax, the top-k, renormalised."""
        router = TopKRouter(MODEL_DIM, 8, 3, init_fn=_normal)

        x = torch.randn(64, MODEL_DIM)

        if bf16_weights:
            router.bfloat16()

            x = x.bfloat16()

        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not bf16_weights):
            probs, weights, indices = router(x)

            # transformers 5.24 `Qwen3_5MoeTopKRouter.forward`, written out.
            expected_logits = F.linear(x, router.weight)

        assert expected_logits.dtype == torch.bfloat16

        expected_probs = F.softmax(expected_logits, dim=-1, dtype=torch.float)

        expected_weights, expected_indices = expected_probs.topk(3, dim=-1)

        expected_weights = expected_weights / expected_weights.sum(dim=-1, keepdim=True)

        assert probs.dtype == torch.float32 and weights.dtype == torch.float32

        assert torch.equal(probs, expected_probs)
        assert torch.equal(indices, expected_indices)
        assert torch.equal(weights, expected_weights)

    @pytest.mark.parametrize("bf16_weights", [False, True], ids=["autocast", "bf16-weights"])
    def test_fp32_precision_routes_in_fp32(self, bf16_weights: bool) -> None:
        router = TopKRouter(MODEL_DIM, 8, 3, precision="fp32", init_fn=_normal)

        x = torch.randn(64, MODEL_DIM)

        if bf16_weights:
            router.bfloat16()

            x = x.bfloat16()

        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not bf16_weights):
            probs, weights, indices = router(x)

        expected_probs = (x.double() @ router.weight.double().t()).softmax(dim=-1).float()

        torch.testing.assert_close(probs, expected_probs, atol=1e-6, rtol=1e-5)

        expected_weights, expected_indices = expected_probs.topk(3, dim=-1)

        assert torch.equal(indices, expected_indices)

        torch.testing.assert_close(weights, expected_weights / expected_weights.sum(dim=-1, keepdim=True))

    def test_the_two_precisions_route_a_near_tie_differently(self) -> None:
        """Expert 0 wins in exact arithmetic (16 + 7.2 u against 16 + 4.95 u,
        u = 2⁻⁷); in bf16 its weights round down to 1, expert 1's first nine
        round up to 1 + u, and expert 1 wins (16.125 against 16)."""
        u = 2.0**-7

        weight = torch.ones(2, MODEL_DIM)

        weight[0] += 0.45 * u
        weight[1, :9] += 0.55 * u

        x = torch.ones(1, MODEL_DIM)

        top1 = {}

        for precision in ("activation", "fp32"):
            router = TopKRouter(MODEL_DIM, 2, 1, precision=precision)  # type: ignore[arg-type]

            with torch.no_grad():
                router.weight.copy_(weight)

            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, _, indices = router(x)

            top1[precision] = indices.item()

        assert top1 == {"activation": 1, "fp32": 0}

    def test_renormalizes_only_when_asked(self) -> None:
        x = torch.randn(5, MODEL_DIM)

        torch.manual_seed(0)

        normalized = TopKRouter(MODEL_DIM, 6, 3, init_fn=_normal)

        torch.manual_seed(0)

        raw = TopKRouter(MODEL_DIM, 6, 3, normalize_top_k=False, init_fn=_normal)

        probs, raw_weights, _ = raw(x)
        _, weights, _ = normalized(x)

        torch.testing.assert_close(weights.sum(dim=-1), torch.ones(5))

        torch.testing.assert_close(raw_weights, probs.topk(3, dim=-1).values)


class TestQwen35MoeBlock:
    @pytest.mark.parametrize("dispatch", ["batched", "loop"])
    @pytest.mark.parametrize("normalize_top_k", [True, False])
    @pytest.mark.parametrize("shape", [(3, 7, MODEL_DIM), (11, MODEL_DIM)])
    def test_forward_and_gradients_match_naive_moe(
        self, shape: tuple[int, ...], normalize_top_k: bool, dispatch: ExpertDispatch
    ) -> None:
        block = _make_block(normalize_top_k=normalize_top_k, dispatch=dispatch)

        reference = copy.deepcopy(block)

        seqs = torch.randn(shape)

        output = block(seqs)
        expected = _naive_moe(reference, seqs)

        torch.testing.assert_close(output, expected, atol=1e-6, rtol=1e-5)

        cotangent = torch.randn_like(output)

        torch.autograd.backward((output * cotangent).sum())
        torch.autograd.backward((expected * cotangent).sum())

        grads, expected_grads = _grads(block), _grads(reference)

        assert grads.keys() == expected_grads.keys()

        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], atol=1e-5, rtol=1e-5, msg=name)

    def test_experts_compute_only_routed_tokens(self) -> None:
        block = _make_block(num_experts=6, top_k=2)

        calls: list[tuple[int, list[int]]] = []

        def record(module: torch.nn.Module, args: tuple[Tensor, Tensor]) -> None:
            calls.append((args[0].size(0), args[1].tolist()))

        block.experts.register_forward_pre_hook(record)

        block(torch.randn(10, MODEL_DIM))

        [(num_rows, tokens_per_expert)] = calls

        # 10 tokens x 2 slots, not 10 tokens x 6 experts.
        assert num_rows == 20 and sum(tokens_per_expert) == 20

    @pytest.mark.parametrize("dispatch", ["batched", "loop"])
    def test_an_expert_without_tokens_gets_zero_gradient(self, dispatch: ExpertDispatch) -> None:
        block = _make_block(num_experts=6, top_k=1, dispatch=dispatch)

        # Route every token to expert 0.
        with torch.no_grad():
            block.router.weight.zero_()
            block.router.weight[0, 0] = 100.0

        seqs = torch.randn(4, MODEL_DIM).abs()

        torch.autograd.backward(block(seqs).sum())

        grad = block.experts.gate_inner_proj.grad

        assert grad is not None

        assert grad[0].abs().sum() > 0 and grad[1:].abs().sum() == 0


    # `batched` falls back to `loop` without rows; `grouped_mm` (CUDA) is not
    # run here.
    @pytest.mark.parametrize("dispatch", ["batched", "loop"])
    def test_a_block_without_tokens_gives_an_empty_output_and_no_expert_gradient(self, dispatch: ExpertDispatch) -> None:
        block = _make_block(dispatch=dispatch)

        seqs = torch.randn(0, MODEL_DIM, requires_grad=True)

        output = block(seqs)

        assert output.shape == (0, MODEL_DIM)

        torch.autograd.backward(output.sum())

        grad = block.experts.gate_inner_proj.grad

        assert grad is None or grad.abs().sum() == 0


class TestRoutedExperts:
    @pytest.mark.parametrize("init_fn", [None, _normal], ids=["default", "init_fn"])
    def test_reset_parameters_keeps_the_held_experts_of_the_whole_draw(self, init_fn: object) -> None:
        # What expert parallelism leaves a rank: some experts, reordered.
        # Each must be the expert of the unsharded module of the same seed,
        # as on every rank, which fairseq2 seeds alike.
        torch.manual_seed(4)

        whole = RoutedExperts(6, 8, 4, init_fn=init_fn)  # type: ignore[arg-type]

        part = RoutedExperts(6, 8, 4, init_fn=init_fn)  # type: ignore[arg-type]

        with torch.no_grad():
            part.gate_inner_proj = torch.nn.Parameter(part.gate_inner_proj[:2].clone())
            part.output_proj = torch.nn.Parameter(part.output_proj[:2].clone())

        part.expert_ids = (4, 1)

        torch.manual_seed(4)

        part.reset_parameters()

        assert torch.equal(part.gate_inner_proj, whole.gate_inner_proj[[4, 1]])
        assert torch.equal(part.output_proj, whole.output_proj[[4, 1]])

        assert not torch.equal(whole.gate_inner_proj[4], whole.gate_inner_proj[1])

    def test_grouped_mm_path_matches_the_fallbacks(self, monkeypatch: pytest.MonkeyPatch) -> None:
        # PyTorch 2.9 runs the forward pass of `_grouped_mm` on CPU, which
        # checks our use of it (offsets, transposed weights) without a GPU.
        torch.manual_seed(0)

        experts = RoutedExperts(5, MODEL_DIM, 8, dispatch="grouped_mm", init_fn=_normal)

        monkeypatch.setattr(RoutedExperts, "_grouped_mm_unsupported_reason", lambda self, seqs: None)

        # An expert without tokens in the middle, the last one too.
        tokens_per_expert = torch.tensor([3, 0, 4, 2, 0])

        seqs = torch.randn(9, MODEL_DIM)

        with torch.no_grad():
            grouped = experts(seqs, tokens_per_expert)

            for fallback in ("batched", "loop"):
                experts.dispatch = fallback

                torch.testing.assert_close(experts(seqs, tokens_per_expert), grouped, atol=1e-5, rtol=1e-5)

    def test_fallbacks_agree_in_forward_and_backward(self) -> None:
        torch.manual_seed(0)

        batched = RoutedExperts(5, MODEL_DIM, 8, dispatch="batched", init_fn=_normal)

        looped = copy.deepcopy(batched)

        looped.dispatch = "loop"

        tokens_per_expert = torch.tensor([3, 0, 7, 1, 0])

        seqs = torch.randn(11, MODEL_DIM, requires_grad=True)
        seqs_looped = seqs.detach().clone().requires_grad_()

        output, output_looped = batched(seqs, tokens_per_expert), looped(seqs_looped, tokens_per_expert)

        torch.testing.assert_close(output, output_looped)

        cotangent = torch.randn_like(output)

        torch.autograd.backward((output * cotangent).sum())
        torch.autograd.backward((output_looped * cotangent).sum())

        torch.testing.assert_close(seqs.grad, seqs_looped.grad)

        for name, grad in _grads(looped).items():
            torch.testing.assert_close(_grads(batched)[name], grad, msg=name)

    @pytest.mark.parametrize("dispatch", ["batched", "loop"])
    def test_leaves_no_uninitialized_memory_in_outputs_or_gradients(
        self, dispatch: ExpertDispatch, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # The fallbacks allocate outputs and weight gradients uninitialized
        # and write what they compute into them; experts without tokens must
        # still get zero gradients. Freshly allocated memory is often zero by
        # chance, so here every `empty_like` and `new_empty` holds NaN.
        torch.manual_seed(0)

        experts = RoutedExperts(5, MODEL_DIM, 8, dispatch=dispatch, init_fn=_normal)

        tokens_per_expert = torch.tensor([3, 0, 7, 1, 0])

        seqs = torch.randn(11, MODEL_DIM, requires_grad=True)

        cotangent = torch.randn(11, MODEL_DIM)

        empty_like, new_empty = torch.empty_like, Tensor.new_empty

        monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: empty_like(*args, **kwargs).fill_(torch.nan))
        monkeypatch.setattr(Tensor, "new_empty", lambda *args, **kwargs: new_empty(*args, **kwargs).fill_(torch.nan))

        output = experts(seqs, tokens_per_expert)

        torch.autograd.backward((output * cotangent).sum())

        monkeypatch.undo()

        # The same in plain autograd, one expert at a time.
        expected = _grads_of_experts_one_by_one(experts, seqs.detach(), tokens_per_expert.tolist(), cotangent)

        torch.testing.assert_close(output.detach(), expected.pop("output"))

        torch.testing.assert_close(seqs.grad, expected.pop("seqs"))

        grads = _grads(experts)

        assert grads.keys() == expected.keys()

        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], msg=name)

            # Experts 1 and 4 got no tokens.
            assert grad[[1, 4]].eq(0).all(), name

    @pytest.mark.parametrize("dispatch", ["batched", "loop"])
    def test_operator_matches_the_eager_path(self, dispatch: ExpertDispatch) -> None:
        # Under `torch.compile` the experts run as `qwen35_fs2::swiglu_experts`.
        torch.manual_seed(0)

        experts = RoutedExperts(5, MODEL_DIM, 8, dispatch=dispatch, init_fn=_normal)

        tokens_per_expert = torch.tensor([3, 0, 7, 1, 0])

        seqs = torch.randn(11, MODEL_DIM, requires_grad=True)

        leaves = [t.detach().clone().requires_grad_() for t in (seqs, experts.gate_inner_proj, experts.output_proj)]

        expected = experts(seqs, tokens_per_expert)

        output, _ = torch.ops.qwen35_fs2.swiglu_experts(*leaves, tokens_per_expert, dispatch)

        torch.testing.assert_close(output, expected)

        cotangent = torch.randn_like(output)

        torch.autograd.backward((expected * cotangent).sum())
        torch.autograd.backward((output * cotangent).sum())

        expected_grads = [seqs.grad, experts.gate_inner_proj.grad, experts.output_proj.grad]

        for leaf, expected_grad in zip(leaves, expected_grads):
            torch.testing.assert_close(leaf.grad, expected_grad)

    @pytest.mark.slow
    @pytest.mark.parametrize("dispatch", ["batched", "loop"])
    def test_operator_passes_opcheck(self, dispatch: ExpertDispatch) -> None:
        generator = torch.Generator().manual_seed(0)

        def randn(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=generator).requires_grad_()

        tokens_per_expert = torch.tensor([3, 0, 7, 1, 0])

        seqs, gate_inner_proj, output_proj = randn(11, MODEL_DIM), randn(5, 16, MODEL_DIM), randn(5, MODEL_DIM, 8)

        torch.library.opcheck(
            torch.ops.qwen35_fs2.swiglu_experts.default,
            (seqs, gate_inner_proj, output_proj, tokens_per_expert, dispatch),
        )

        _, gate_inner = torch.ops.qwen35_fs2.swiglu_experts(
            seqs, gate_inner_proj, output_proj, tokens_per_expert, dispatch
        )

        torch.library.opcheck(
            torch.ops.qwen35_fs2.swiglu_experts_backward.default,
            (torch.randn(11, MODEL_DIM), seqs.detach(), gate_inner, gate_inner_proj.detach(), output_proj.detach(), tokens_per_expert, dispatch),
        )

    def test_auto_dispatch_loops_on_cpu_and_pads_moderately_unbalanced_groups_on_gpus(self) -> None:
        experts = RoutedExperts(4, MODEL_DIM, 8)

        cpu, gpu = torch.device("cpu"), torch.device("cuda")

        # 4 x 5 = 20 padded rows for 14 tokens; then 4 x 9 = 36 for 12.
        assert experts.resolve_fallback([5, 3, 2, 4], gpu) == "batched"
        assert experts.resolve_fallback([9, 1, 1, 1], gpu) == "loop"

        assert experts.resolve_fallback([5, 3, 2, 4], cpu) == "loop"

        # Chosen, each runs anywhere.
        for dispatch in ("batched", "loop"):
            experts.dispatch = dispatch

            assert experts.resolve_fallback([5, 3, 2, 4], cpu) == dispatch
            assert experts.resolve_fallback([9, 1, 1, 1], gpu) == dispatch

    @pytest.mark.parametrize("dispatch", ["auto", "batched", "loop"])
    def test_experts_without_any_token_run_and_get_zero_gradients(self, dispatch: ExpertDispatch) -> None:
        # An expert-parallel rank can receive no token; groups padded to a
        # capacity of 0 cannot be batched.
        experts = RoutedExperts(5, MODEL_DIM, 8, dispatch=dispatch, init_fn=_normal)

        assert experts.resolve_fallback([0, 0, 0, 0, 0], torch.device("cuda")) == "loop"

        seqs = torch.randn(0, MODEL_DIM, requires_grad=True)

        tokens_per_expert = torch.zeros(5, dtype=torch.int64)

        eager = experts(seqs, tokens_per_expert)

        compiled, _ = torch.ops.qwen35_fs2.swiglu_experts(seqs, experts.gate_inner_proj, experts.output_proj, tokens_per_expert, dispatch)

        for output in (eager, compiled):
            assert output.shape == (0, MODEL_DIM)

            output.sum().backward()

        assert seqs.grad is not None and seqs.grad.shape == (0, MODEL_DIM)

        grads = _grads(experts)

        assert sorted(grads) == ["gate_inner_proj", "output_proj"]

        for name, grad in grads.items():
            assert torch.count_nonzero(grad) == 0, name

    def test_grouped_mm_dispatch_raises_error_on_cpu(self) -> None:
        experts = RoutedExperts(4, MODEL_DIM, 8, dispatch="grouped_mm")

        with pytest.raises(NotSupportedError, match="`grouped_mm` expert dispatch cannot run here: it needs a CUDA device"):
            experts(torch.randn(3, MODEL_DIM), torch.tensor([1, 1, 1, 0]))

    @pytest.mark.cuda
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    def test_grouped_mm_forward_and_backward_match_loop_on_cuda(self) -> None:
        if torch.cuda.get_device_capability() < (9, 0):
            pytest.skip("`torch._grouped_mm` needs compute capability 9.0")

        torch.manual_seed(0)

        device = torch.device("cuda")

        experts = RoutedExperts(6, 64, 32, dispatch="grouped_mm", init_fn=_normal, device=device, dtype=torch.bfloat16)

        reference = copy.deepcopy(experts)

        reference.dispatch = "loop"

        tokens_per_expert = torch.tensor([5, 0, 17, 1, 9, 0], device=device)

        seqs = torch.randn(32, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
        seqs_ref = seqs.detach().clone().requires_grad_()

        output = experts(seqs, tokens_per_expert)
        expected = reference(seqs_ref, tokens_per_expert)

        torch.testing.assert_close(output, expected, atol=2e-2, rtol=2e-2)

        torch.autograd.backward(output.float().sum())
        torch.autograd.backward(expected.float().sum())

        torch.testing.assert_close(seqs.grad, seqs_ref.grad, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(experts.gate_inner_proj.grad, reference.gate_inner_proj.grad, atol=5e-2, rtol=2e-2)

    @pytest.mark.cuda
    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    def test_grouped_mm_without_tokens_gives_zero_gradients_on_cuda(self) -> None:
        # A rank of an expert-parallel group can receive no token at all;
        # the CPU paths are tested above, this is `torch._grouped_mm` with
        # no rows. Freed memory filled with NaN first, so that a gradient
        # left unwritten shows.
        if torch.cuda.get_device_capability() < (9, 0):
            pytest.skip("`torch._grouped_mm` needs compute capability 9.0")

        device = torch.device("cuda")

        torch.full((1 << 24,), float("nan"), device=device)

        experts = RoutedExperts(6, 64, 32, dispatch="grouped_mm", init_fn=_normal, device=device, dtype=torch.bfloat16)

        seqs = torch.randn(0, 64, device=device, dtype=torch.bfloat16, requires_grad=True)

        output = experts(seqs, torch.zeros(6, dtype=torch.int64, device=device))

        assert output.shape == (0, 64)

        torch.autograd.backward(output.float().sum())

        for name in ("gate_inner_proj", "output_proj"):
            grad = getattr(experts, name).grad

            assert grad is not None and torch.count_nonzero(grad) == 0, name


def _route(blocks: list[Qwen35MoeBlock], inputs: list[Tensor], layout: BatchLayout | None = None) -> MoeStatistics:
    """Runs ``blocks`` on ``inputs`` in one forward pass, as the decoder does,
    and collects their statistics."""
    recorder = MoeStatisticsRecorder()

    for block, x in zip(blocks, inputs):
        block(x, layout, statistics=recorder)

    return recorder.collect(blocks)


def _hf_aux_loss(blocks: list[Qwen35MoeBlock], inputs: list[Tensor], attention_mask: Tensor | None) -> Tensor:
    """transformers' loss on the router logits of ``blocks``."""
    logits = tuple(F.linear(x.reshape(-1, MODEL_DIM), b.router.weight) for b, x in zip(blocks, inputs))

    num_experts = blocks[0].router.num_experts

    # Annotated `tuple[Tensor]`, but takes one tensor per layer.
    loss = load_balancing_loss_func(logits, num_experts, blocks[0].router.top_k, attention_mask)  # type: ignore[arg-type]

    assert isinstance(loss, Tensor)

    return loss


class TestLoadBalancingLoss:
    @pytest.mark.parametrize("top_k", [1, 2, 3])
    def test_equals_transformers_over_several_layers(self, top_k: int) -> None:
        blocks = [_make_block(num_experts=5, top_k=top_k, seed=seed) for seed in range(3)]

        inputs = [torch.randn(4, 6, MODEL_DIM) for _ in blocks]

        statistics = _route(blocks, inputs)

        expected = _hf_aux_loss(blocks, inputs, None)

        assert abs(statistics.load_balancing_loss.item() - expected.item()) <= 1e-6

    def test_leaves_out_padding(self) -> None:
        blocks = [_make_block(num_experts=5, top_k=2, seed=seed) for seed in range(2)]

        seq_lens = [6, 2, 4]

        layout = BatchLayout((3, 6), seq_lens)

        attention_mask = (torch.arange(6) < torch.tensor(seq_lens).unsqueeze(1)).long()

        inputs = [torch.randn(3, 6, MODEL_DIM) for _ in blocks]

        statistics = _route(blocks, inputs, layout)

        expected = _hf_aux_loss(blocks, inputs, attention_mask)

        assert abs(statistics.load_balancing_loss.item() - expected.item()) <= 1e-6

        # Pads changed, real tokens kept: the same loss.
        for x in inputs:
            x[attention_mask == 0] = torch.randn(int((attention_mask == 0).sum()), MODEL_DIM)

        again = _route(blocks, inputs, layout)

        torch.testing.assert_close(again.load_balancing_loss, statistics.load_balancing_loss)

        assert statistics.num_tokens.item() == sum(seq_lens)

        assert statistics.tokens_per_expert.sum(dim=1).tolist() == [2 * sum(seq_lens)] * 2

    def test_leaves_out_the_padded_tail_of_a_packed_batch(self) -> None:
        block = _make_block(num_experts=5, top_k=2)

        seq_lens = [3, 4]

        x = torch.randn(9, MODEL_DIM)

        statistics = _route([block], [x], BatchLayout((9,), seq_lens, packed=True))

        expected = _hf_aux_loss([block], [x[:7]], None)

        assert abs(statistics.load_balancing_loss.item() - expected.item()) <= 1e-6

    def test_gradient_of_the_aux_loss_alone_reaches_the_router(self) -> None:
        blocks = [_make_block(num_experts=5, top_k=2, seed=seed) for seed in range(2)]

        references = copy.deepcopy(blocks)

        inputs = [torch.randn(2, 5, MODEL_DIM) for _ in blocks]

        statistics = _route(blocks, inputs)

        torch.autograd.backward(statistics.load_balancing_loss)

        torch.autograd.backward(_hf_aux_loss(references, inputs, None))

        for block, reference in zip(blocks, references):
            grad = block.router.weight.grad

            assert grad is not None and grad.abs().sum() > 0

            torch.testing.assert_close(grad, reference.router.weight.grad, atol=1e-7, rtol=1e-5)

            # Only the router shapes the aux loss.
            assert block.experts.gate_inner_proj.grad is None

    def test_is_one_when_routing_is_uniform_with_top_1(self) -> None:
        block = _make_block(num_experts=4, top_k=1)

        with torch.no_grad():
            block.router.weight.copy_(torch.eye(4, MODEL_DIM) * 50.0)

        # Each token goes to a distinct expert with probability ~1.
        statistics = _route([block], [torch.eye(4, MODEL_DIM)])

        torch.testing.assert_close(statistics.load_balancing_loss, torch.tensor(1.0))

        assert statistics.max_tokens_per_expert.item() == 1
        assert statistics.min_tokens_per_expert.item() == 1
        assert statistics.num_dropped_assignments.item() == 0


class TestCollectMoeStatistics:
    def test_returns_none_for_a_dense_model(self) -> None:
        assert collect_moe_statistics(torch.nn.Linear(2, 2)) is None

    def test_raises_error_without_a_forward_pass(self) -> None:
        block = _make_block()

        recorder = MoeStatisticsRecorder()

        block(torch.randn(3, MODEL_DIM), statistics=recorder)

        recorder.collect([block])

        with pytest.raises(RuntimeError, match=r"MoE layers \[0\] have no routing statistics"):
            recorder.collect([block])

    def test_returned_statistics_are_those_recorded(self) -> None:
        # The decoder layers take them returned (under activation
        # checkpointing and `torch.compile`, recording would break the
        # graph); the block records the same.
        block = _make_block()

        x = torch.randn(2, 5, MODEL_DIM)

        layout = BatchLayout((2, 5), [5, 3])

        recorder = MoeStatisticsRecorder()

        recorded_output = block(x, layout, statistics=recorder)

        output, returned = block(x, layout, return_statistics=True)

        assert torch.equal(output, recorded_output)

        recorded = recorder.collect([block])

        assert returned.num_tokens.item() == recorded.num_tokens.item() == 8

        assert torch.equal(returned.tokens_per_expert, recorded.tokens_per_expert[0])

        with pytest.raises(ValueError, match=r"`statistics` must be `None` when `return_statistics` is set"):
            block(x, layout, statistics=recorder, return_statistics=True)

    # With early stopping, the recomputation ends before the statistics.
    @pytest.mark.parametrize("early_stop", [True, False])
    def test_activation_checkpointing_keeps_statistics_and_gradients(self, early_stop: bool) -> None:
        config = tiny_qwen35_moe_config()

        torch.manual_seed(0)

        model = create_qwen35_moe_model(config).train()

        checkpointed = copy.deepcopy(model)

        apply_ac_to_transformer_lm(checkpointed, every_nth_layer=1)

        seqs = torch.randint(1, config.vocab_size, (2, 12))
        targets = torch.randint(1, config.vocab_size, (2, 12))

        layout = BatchLayout((2, 12), [12, 7])

        def loss(m: torch.nn.Module) -> Tensor:
            nll: Tensor = m(seqs, layout, targets, reduction="mean")

            statistics = collect_moe_statistics(m)

            assert statistics is not None

            return nll + 0.1 * statistics.load_balancing_loss

        torch.autograd.backward(loss(model))

        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            torch.autograd.backward(loss(checkpointed))

        # The recomputation in the backward pass recorded nothing.
        assert collect_moe_statistics_or_none(checkpointed) is None

        grads, checkpointed_grads = _grads(model), _grads(checkpointed)

        assert grads.keys() == checkpointed_grads.keys()

        for name, grad in grads.items():
            torch.testing.assert_close(checkpointed_grads[name], grad, msg=name)

    # Without early stopping, the recomputation reaches the statistics.
    @pytest.mark.parametrize("early_stop", [True, False])
    def test_the_recipes_activation_checkpointing_counts_statistics_once(self, early_stop: bool) -> None:
        """Collected after the backward pass, in which the checkpointed layers
        rerun their forward passes: the statistics are those of the model
        without checkpointing."""
        config = tiny_qwen35_moe_config()

        torch.manual_seed(0)

        model = create_qwen35_moe_model(config).train()

        # The applier of the recipes (`trainer.activation_checkpointing`).
        checkpointed = apply_ac_to_qwen35(copy.deepcopy(model), every_nth_layer=1)

        seqs = torch.randint(1, config.vocab_size, (2, 12))
        targets = torch.randint(1, config.vocab_size, (2, 12))

        layout = BatchLayout((2, 12), [12, 7])

        def statistics_after_backward(m: torch.nn.Module) -> MoeStatistics:
            torch.autograd.backward(m(seqs, layout, targets, reduction="mean"))

            statistics = collect_moe_statistics(m)

            assert statistics is not None

            return statistics

        expected = statistics_after_backward(model)

        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            statistics = statistics_after_backward(checkpointed)

        assert torch.equal(statistics.tokens_per_expert, expected.tokens_per_expert)

        assert statistics.num_tokens.item() == expected.num_tokens.item() == 19

        torch.testing.assert_close(statistics.load_balancing_loss, expected.load_balancing_loss)

    @pytest.mark.parametrize("checkpointed", [False, True])
    def test_no_module_holds_an_autograd_graph_between_steps(self, checkpointed: bool) -> None:
        config = tiny_qwen35_moe_config()

        model = create_qwen35_moe_model(config).train()

        if checkpointed:
            apply_ac_to_qwen35(model, every_nth_layer=1)

        seqs = torch.randint(1, config.vocab_size, (2, 12))
        targets = torch.randint(1, config.vocab_size, (2, 12))

        layout = BatchLayout((2, 12), [12, 7])

        def training_forward() -> Tensor:
            nll: Tensor = model(seqs, layout, targets, reduction="mean")

            return nll

        # A training step as the recipes take it.
        loss = training_forward()

        statistics = collect_moe_statistics(model)

        assert statistics is not None

        torch.autograd.backward(loss + 0.1 * statistics.load_balancing_loss)

        del loss, statistics

        assert _graph_references(model) == []

        # A forward pass whose statistics nobody collects holds its graph
        # until the next one, here a validation pass.
        training_forward()

        assert _graph_references(model) != []

        model.eval()

        with torch.no_grad():
            model(seqs, layout)

        assert _graph_references(model) == []

    def test_the_decoder_layer_passes_its_batch_layout_to_the_block(self) -> None:
        config = tiny_qwen35_moe_config()

        model = create_qwen35_moe_model(config).eval()

        seqs = torch.randint(1, config.vocab_size, (2, 12))

        with torch.no_grad():
            model(seqs, BatchLayout((2, 12), [12, 5]))

        statistics = collect_moe_statistics(model)

        assert statistics is not None

        assert statistics.num_tokens.item() == 17

        assert statistics.tokens_per_expert.shape == (config.num_layers, config.experts.num_experts)

    def test_a_deep_copy_records_its_own_statistics(self) -> None:
        model = create_qwen35_moe_model(tiny_qwen35_moe_config()).eval()

        copied = copy.deepcopy(model)

        seqs = torch.randint(1, 100, (2, 6))

        with torch.no_grad():
            copied(seqs, BatchLayout((2, 6), [6, 3]))

        statistics = collect_moe_statistics(copied)

        assert statistics is not None and statistics.num_tokens.item() == 9

        # The original saw nothing.
        assert collect_moe_statistics_or_none(model) is None


def _graph_references(model: torch.nn.Module) -> list[str]:
    """Returns where the state of the modules of ``model`` (their attributes,
    and what those hold) refers to a tensor with an autograd graph."""
    found = []

    seen: set[int] = set()

    def visit(obj: object, path: str) -> None:
        if id(obj) in seen:
            return

        seen.add(id(obj))

        if isinstance(obj, Tensor):
            if obj.grad_fn is not None:
                found.append(path)

            return

        # Modules are walked on their own, types hold no state of a model.
        if isinstance(obj, (torch.nn.Module, type)):
            return

        if isinstance(obj, dict):
            for key, value in obj.items():
                visit(value, f"{path}[{key!r}]")
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for idx, value in enumerate(obj):
                visit(value, f"{path}[{idx}]")
        elif hasattr(obj, "__dict__"):
            for name, value in vars(obj).items():
                visit(value, f"{path}.{name}")

    for module_name, module in model.named_modules():
        for name, value in vars(module).items():
            visit(value, f"{module_name}.{name}")

    return found


def collect_moe_statistics_or_none(model: torch.nn.Module) -> object:
    """Returns ``None`` if ``model`` holds no statistics."""
    try:
        return collect_moe_statistics(model)
    except RuntimeError as ex:
        if "have no routing statistics" not in str(ex):
            raise

        return None
