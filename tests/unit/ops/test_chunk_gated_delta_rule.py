"""The chunked gated delta rule against the token-by-token reference."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from qwen35_fs2.ops import chunk_gated_delta_rule, recurrent_gated_delta_rule

from .helpers import (
    DeltaRuleInputs,
    assert_close,
    cu_seqlens_of,
    make_delta_rule_inputs,
    random_lengths,
)

# (B, T, H, HV, K, V, chunk size): awkward lengths around the chunk size, and
# 1, 2 and 3 value heads per query/key head.
SHAPES = [
    (1, 63, 2, 4, 16, 16, 64),
    (2, 64, 2, 2, 16, 24, 64),
    (1, 65, 1, 3, 24, 16, 64),
    (2, 150, 2, 4, 32, 32, 32),
    (1, 97, 3, 6, 8, 12, 16),
    (3, 1, 1, 2, 8, 8, 64),
]


def shape_id(shape: tuple[int, ...]) -> str:
    return "B{}-T{}-H{}-HV{}-K{}-V{}-C{}".format(*shape)


def run_with_grads(
    kernel: object,
    inputs: DeltaRuleInputs,
    initial_state: Tensor,
    do: Tensor,
    dht: Tensor,
    **kwargs: object,
) -> dict[str, Tensor]:
    """Runs ``kernel`` on fresh leaves, backpropagates ``do`` and ``dht``, and
    returns the outputs and every gradient by name."""
    leaves = inputs.leaves()

    h0 = initial_state.detach().clone().requires_grad_()

    o, ht = kernel(  # type: ignore[operator]
        *leaves.tensors(), initial_state=h0, output_final_state=True, **kwargs
    )

    torch.autograd.backward([o, ht], [do, dht])

    grads = {f"d{name}": getattr(leaves, name).grad for name in ("q", "k", "v", "g", "beta")}

    return {"o": o, "ht": ht, **grads, "dh0": h0.grad}


class TestChunkGatedDeltaRule:
    @pytest.mark.parametrize("max_decay", [1.0, 16.0], ids=["mild-decay", "strong-decay"])
    @pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
    def test_outputs_states_and_gradients_match_recurrent_reference(
        self, shape: tuple[int, ...], max_decay: float
    ) -> None:
        batch_size, seq_len, num_heads, num_v_heads, key_dim, value_dim, chunk_size = shape

        inputs = make_delta_rule_inputs(
            batch_size, seq_len, num_heads, num_v_heads, key_dim, value_dim, max_decay=max_decay
        )

        gen = torch.Generator().manual_seed(1)

        h0 = torch.randn(batch_size, num_v_heads, key_dim, value_dim, generator=gen)
        do = torch.randn(batch_size, seq_len, num_v_heads, value_dim, generator=gen)
        dht = torch.randn(batch_size, num_v_heads, key_dim, value_dim, generator=gen)

        expected = run_with_grads(recurrent_gated_delta_rule, inputs, h0, do, dht)

        actual = run_with_grads(chunk_gated_delta_rule, inputs, h0, do, dht, chunk_size=chunk_size)

        for name, ratio in TOLERANCES.items():
            assert_close(name, expected[name], actual[name], ratio)

    @pytest.mark.parametrize("max_decay", [1.0, 16.0], ids=["mild-decay", "strong-decay"])
    def test_2000_tokens_match_recurrent_reference(self, max_decay: float) -> None:
        inputs = make_delta_rule_inputs(1, 2000, 2, 4, 32, 32, max_decay=max_decay, seed=2)

        expected_o, expected_ht = recurrent_gated_delta_rule(*inputs.tensors(), output_final_state=True)

        o, ht = chunk_gated_delta_rule(*inputs.tensors(), output_final_state=True)

        assert_close("o", expected_o, o, 1e-5)
        assert_close("ht", expected_ht, ht, 1e-5)

    def test_extreme_decays_and_repeated_keys_stay_finite(self) -> None:
        inputs = make_delta_rule_inputs(1, 300, 1, 3, 16, 16, seed=3)

        # No decay, a decay of e^-10^4 per token, and both alternating; every
        # key the same and beta = 1 (the most ill-conditioned system).
        g = torch.zeros(1, 300, 3)
        g[..., 1] = -1e4
        g[:, ::2, 2] = -1e4

        inputs.g = g
        inputs.k = inputs.k[:, :1].expand_as(inputs.k).contiguous()
        inputs.beta = torch.ones_like(inputs.beta)

        expected = run_with_grads(
            recurrent_gated_delta_rule, inputs, torch.zeros(1, 3, 16, 16), torch.ones(1, 300, 3, 16), torch.ones(1, 3, 16, 16)
        )

        actual = run_with_grads(
            chunk_gated_delta_rule, inputs, torch.zeros(1, 3, 16, 16), torch.ones(1, 300, 3, 16), torch.ones(1, 3, 16, 16)
        )

        for name in ("o", "ht", "dq", "dk", "dv", "dbeta", "dh0"):
            assert_close(name, expected[name], actual[name], 1e-4)

        assert torch.isfinite(actual["dg"]).all()

    @pytest.mark.parametrize(
        "shape,packed,use_qk_l2norm",
        [
            ((2, 10, 1, 2, 4, 3, 4), False, True),
            ((1, 13, 2, 6, 3, 2, 4), True, True),
            ((2, 9, 2, 2, 5, 4, 3), False, False),
        ],
        ids=["B2-T10-H1-HV2-C4", "packed-T13-H2-HV6-C4", "B2-T9-H2-HV2-C3-no-l2norm"],
    )
    def test_backward_passes_gradcheck_in_float64(
        self, shape: tuple[int, ...], packed: bool, use_qk_l2norm: bool
    ) -> None:
        batch_size, seq_len, num_heads, num_v_heads, key_dim, value_dim, chunk_size = shape

        inputs = make_delta_rule_inputs(
            batch_size, seq_len, num_heads, num_v_heads, key_dim, value_dim, dtype=torch.float64, seed=4
        ).leaves()

        # Lengths 0, 1, a chunk, a chunk + 1 and the rest.
        cu_seqlens = torch.tensor([0, 0, 1, 5, 10, 13]) if packed else None

        num_seqs = batch_size if cu_seqlens is None else len(cu_seqlens) - 1

        h0 = torch.randn(num_seqs, num_v_heads, key_dim, value_dim, dtype=torch.float64).requires_grad_()

        def fn(*args: Tensor) -> tuple[Tensor, Tensor]:
            o, ht = chunk_gated_delta_rule(
                *args[:5],
                initial_state=args[5],
                output_final_state=True,
                cu_seqlens=cu_seqlens,
                use_qk_l2norm=use_qk_l2norm,
                chunk_size=chunk_size,
            )

            assert ht is not None

            return o, ht

        assert torch.autograd.gradcheck(fn, (*inputs.tensors(), h0), atol=1e-7, rtol=1e-6, fast_mode=True)

    @pytest.mark.parametrize(
        "lengths",
        [
            [1, 3, 63, 64, 65, 129],
            random_lengths(700, seed=5, must_include=(64, 1, 65, 63, 3)),
            [0, 200, 0, 7],
        ],
        ids=["edge-lengths", "random-lengths", "empty-documents"],
    )
    def test_packed_documents_match_separate_runs(self, lengths: list[int]) -> None:
        total = sum(lengths)

        inputs = make_delta_rule_inputs(1, total, 2, 4, 16, 16, max_decay=4.0, seed=6)

        gen = torch.Generator().manual_seed(7)

        h0 = torch.randn(len(lengths), 4, 16, 16, generator=gen)
        do = torch.randn(1, total, 4, 16, generator=gen)
        dht = torch.randn(len(lengths), 4, 16, 16, generator=gen)

        actual = run_with_grads(
            chunk_gated_delta_rule, inputs, h0, do, dht, cu_seqlens=cu_seqlens_of(lengths)
        )

        begin = 0

        for idx, length in enumerate(lengths):
            end = begin + length

            doc = DeltaRuleInputs(*(t[:, begin:end] for t in inputs.tensors()))

            expected = run_with_grads(
                chunk_gated_delta_rule, doc, h0[idx : idx + 1], do[:, begin:end], dht[idx : idx + 1]
            )

            # Anything leaking between documents is of the order of the
            # outputs; what remains is float rounding. An empty document
            # only passes its state through.
            for name in ("o", "dq", "dk", "dv", "dg", "dbeta") if length > 0 else ():
                assert_close(f"{name} of document {idx}", expected[name], actual[name][:, begin:end], 1e-6)

            for name in ("ht", "dh0"):
                assert_close(f"{name} of document {idx}", expected[name], actual[name][idx : idx + 1], 1e-6)

            begin = end

    @pytest.mark.parametrize("group_size", [1, 2, 3], ids=["HV=H", "HV=2H", "HV=3H"])
    def test_grouped_value_heads_match_repeated_query_key_heads(self, group_size: int) -> None:
        inputs = make_delta_rule_inputs(2, 130, 2, 2 * group_size, 16, 8, seed=8)

        gen = torch.Generator().manual_seed(9)

        h0 = torch.randn(2, 2 * group_size, 16, 8, generator=gen)
        do = torch.randn(2, 130, 2 * group_size, 8, generator=gen)
        dht = torch.randn(2, 2 * group_size, 16, 8, generator=gen)

        actual = run_with_grads(chunk_gated_delta_rule, inputs, h0, do, dht)

        def repeated_kernel(q: Tensor, k: Tensor, *args: Tensor, **kwargs: object) -> tuple[Tensor, Tensor | None]:
            # Value head `j` reads query/key head `j // group_size`.
            q = q.repeat_interleave(group_size, dim=2)
            k = k.repeat_interleave(group_size, dim=2)

            return chunk_gated_delta_rule(q, k, *args, **kwargs)  # type: ignore[arg-type]

        expected = run_with_grads(repeated_kernel, inputs, h0, do, dht)

        for name in expected:
            assert_close(name, expected[name], actual[name], 1e-6)

    @pytest.mark.parametrize("pieces", [[512, 512, 512], [500, 37, 1, 998]], ids=["512-512-512", "500-37-1-998"])
    def test_state_carried_across_pieces_matches_one_pass(self, pieces: list[int]) -> None:
        total = sum(pieces)

        inputs = make_delta_rule_inputs(2, total, 2, 4, 16, 16, seed=10)

        gen = torch.Generator().manual_seed(11)

        h0 = torch.randn(2, 4, 16, 16, generator=gen)
        do = torch.randn(2, total, 4, 16, generator=gen)
        dht = torch.randn(2, 4, 16, 16, generator=gen)

        expected = run_with_grads(chunk_gated_delta_rule, inputs, h0, do, dht)

        def piecewise_kernel(*args: Tensor, initial_state: Tensor, **kwargs: object) -> tuple[Tensor, Tensor | None]:
            outputs: list[Tensor] = []

            state: Tensor | None = initial_state

            begin = 0

            for length in pieces:
                piece = (t[:, begin : begin + length] for t in args)

                o, state = chunk_gated_delta_rule(*piece, initial_state=state, output_final_state=True)

                outputs.append(o)

                begin += length

            return torch.cat(outputs, dim=1), state

        actual = run_with_grads(piecewise_kernel, inputs, h0, do, dht)

        for name in expected:
            assert_close(name, expected[name], actual[name], 1e-5)

    def test_bf16_inputs_give_bf16_outputs_and_gradients_and_fp32_states(self) -> None:
        inputs = make_delta_rule_inputs(1, 100, 2, 4, 16, 16, dtype=torch.bfloat16, seed=12)

        h0 = torch.randn(1, 4, 16, 16)
        do = torch.randn(1, 100, 4, 16, dtype=torch.bfloat16)
        dht = torch.randn(1, 4, 16, 16)

        actual = run_with_grads(chunk_gated_delta_rule, inputs, h0, do, dht)

        fp32_inputs = DeltaRuleInputs(*(t.float() for t in inputs.tensors()))

        expected = run_with_grads(recurrent_gated_delta_rule, fp32_inputs, h0, do.float(), dht)

        assert actual["o"].dtype == torch.bfloat16
        assert actual["ht"].dtype == torch.float32

        for name in ("dq", "dk", "dv", "dg", "dbeta"):
            assert actual[name].dtype == torch.bfloat16, name

        # Only the output and the gradients are rounded to bf16.
        for name in expected:
            assert_close(name, expected[name], actual[name], 1e-2)

    @pytest.mark.parametrize(
        "shape", [(1, 64, 1, 1, 8, 8, 64), (2, 128, 2, 2, 8, 8, 64), (1, 50, 1, 2, 8, 8, 64)], ids=shape_id
    )
    def test_inputs_are_left_unchanged(self, shape: tuple[int, ...]) -> None:
        batch_size, seq_len, num_heads, num_v_heads, key_dim, value_dim, chunk_size = shape

        inputs = make_delta_rule_inputs(batch_size, seq_len, num_heads, num_v_heads, key_dim, value_dim).leaves()

        h0 = torch.randn(batch_size, num_v_heads, key_dim, value_dim, requires_grad=True)

        tensors = (*inputs.tensors(), h0)

        copies = [t.detach().clone() for t in tensors]

        o, ht = chunk_gated_delta_rule(
            *inputs.tensors(), initial_state=h0, output_final_state=True, chunk_size=chunk_size
        )

        assert ht is not None

        torch.autograd.backward([o, ht], [torch.ones_like(o), torch.ones_like(ht)])

        for name, before, after in zip(("q", "k", "v", "g", "beta", "h0"), copies, tensors):
            assert torch.equal(before, after), f"`{name}` was modified in place"

    def test_backward_keeps_about_three_value_sized_tensors(self) -> None:
        inputs = make_delta_rule_inputs(2, 512, 2, 4, 64, 64).leaves()

        input_storages = {t.untyped_storage().data_ptr() for t in inputs.tensors()}

        saved: dict[int, int] = {}

        def pack(t: Tensor) -> Tensor:
            storage = t.untyped_storage()

            if storage.data_ptr() not in input_storages:
                saved[storage.data_ptr()] = storage.nbytes()

            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            chunk_gated_delta_rule(*inputs.tensors())

        # The chunk-start states, `(I + A)^-1` and the writes, each the size
        # of `v` here (C = K = V = 64). transformers' reference keeps ~20x
        # `v`.
        assert sum(saved.values()) <= 3 * inputs.v.nbytes

    @pytest.mark.parametrize(
        "cu_seqlens,match",
        [
            (torch.tensor([0, 5, 9]), "must start at 0 and end at the sequence length T=10"),
            (torch.tensor([2, 10]), "must start at 0"),
            (torch.tensor([0, 6, 4, 10]), "must be non-decreasing"),
            (torch.tensor([0.0, 10.0]), "must be an integer tensor"),
            (torch.tensor([[0, 10]]), "must be a 1-D tensor"),
        ],
        ids=["ends-before-T", "starts-after-0", "decreasing", "float", "2-D"],
    )
    def test_raises_error_when_cu_seqlens_is_inconsistent(self, cu_seqlens: Tensor, match: str) -> None:
        inputs = make_delta_rule_inputs(1, 10, 1, 1, 4, 4)

        with pytest.raises(ValueError, match=match):
            chunk_gated_delta_rule(*inputs.tensors(), cu_seqlens=cu_seqlens)

    def test_raises_error_when_batch_size_is_not_1_with_cu_seqlens(self) -> None:
        inputs = make_delta_rule_inputs(2, 10, 1, 1, 4, 4)

        with pytest.raises(ValueError, match="The batch size must be 1 when `cu_seqlens` is given"):
            chunk_gated_delta_rule(*inputs.tensors(), cu_seqlens=torch.tensor([0, 10]))

    @pytest.mark.parametrize(
        "state_shape", [(2, 2, 4, 4), (1, 2, 4, 5), (2, 4, 4)], ids=["one-state-per-document-missing", "wrong-V", "3-D"]
    )
    def test_raises_error_when_initial_state_has_wrong_shape(self, state_shape: tuple[int, ...]) -> None:
        inputs = make_delta_rule_inputs(1, 10, 1, 2, 4, 4)

        with pytest.raises(ValueError, match=r"`initial_state` must be of shape \[N, HV, K, V\] = \(3, 2, 4, 4\)"):
            chunk_gated_delta_rule(
                *inputs.tensors(), initial_state=torch.zeros(state_shape), cu_seqlens=torch.tensor([0, 3, 3, 10])
            )

    def test_raises_error_when_value_heads_are_not_a_multiple_of_key_heads(self) -> None:
        inputs = make_delta_rule_inputs(1, 10, 2, 3, 4, 4)

        with pytest.raises(ValueError, match=r"HV % H = 1"):
            chunk_gated_delta_rule(*inputs.tensors())

    def test_raises_error_when_chunk_size_is_not_positive(self) -> None:
        inputs = make_delta_rule_inputs(1, 10, 1, 1, 4, 4)

        with pytest.raises(ValueError, match="`chunk_size` must be greater than or equal to 1, but is 0 instead"):
            chunk_gated_delta_rule(*inputs.tensors(), chunk_size=0)

    @pytest.mark.slow
    @pytest.mark.parametrize("packed", [False, True], ids=["regular", "packed"])
    def test_torch_compile_matches_eager(self, packed: bool) -> None:
        inputs = make_delta_rule_inputs(1 if packed else 2, 130, 2, 4, 16, 16, seed=13)

        cu_seqlens = torch.tensor([0, 1, 64, 130]) if packed else None

        num_seqs = 3 if packed else 2

        gen = torch.Generator().manual_seed(14)

        h0 = torch.randn(num_seqs, 4, 16, 16, generator=gen)
        do = torch.randn(inputs.v.shape, generator=gen)
        dht = torch.randn(num_seqs, 4, 16, 16, generator=gen)

        def kernel(*args: Tensor, **kwargs: object) -> tuple[Tensor, Tensor | None]:
            return chunk_gated_delta_rule(*args, cu_seqlens=cu_seqlens, **kwargs)  # type: ignore[arg-type]

        torch._dynamo.reset()

        expected = run_with_grads(kernel, inputs, h0, do, dht)

        # `aot_eager` traces what inductor would (dynamo, then autograd
        # through our `autograd.Function`) without minutes of C++ codegen.
        # Regular batches compile to one graph; packed ones break the graph
        # where `cu_seqlens` is read on the host.
        compiled = torch.compile(kernel, backend="aot_eager", fullgraph=not packed)

        actual = run_with_grads(compiled, inputs, h0, do, dht)

        for name in expected:
            assert_close(name, expected[name], actual[name], 1e-6)


# Per-tensor RMS error ratios of the fp32 chunked kernel against the fp32
# recurrence; measured values are 10-100x smaller.
TOLERANCES = {
    "o": 1e-5,
    "ht": 1e-5,
    "dq": 1e-5,
    "dk": 1e-5,
    "dv": 1e-5,
    "dg": 1e-5,
    "dbeta": 1e-5,
    "dh0": 1e-5,
}
