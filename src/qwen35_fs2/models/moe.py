"""The sparse Mixture-of-Experts block of Qwen3.5-MoE (and Qwen3-Next), and
the load-balancing statistics that training adds to the loss."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, final

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.nn import Module, Parameter
from typing_extensions import override

from fairseq2.data_type import DataType
from fairseq2.device import Device
from fairseq2.error import NotSupportedError
from fairseq2.gang import Gangs, get_current_gangs
from fairseq2.models.transformer import FeedForwardNetwork
from fairseq2.nn import BatchLayout
from fairseq2.nn.sharded import Sharded
from fairseq2.ops.tensor_parallel import reduce, reduce_on_backward

from qwen35_fs2.models.tp import check_tp_divisible, sum_gradient_over_tp
from qwen35_fs2.ops.autocast import autocast_dtype, autocast_free

ExpertDispatch = Literal["auto", "grouped_mm", "batched", "loop"]
"""
How :class:`RoutedExperts` runs the experts on their tokens:

- ``grouped_mm``: one ``torch._grouped_mm`` per projection (CUDA compute
  capability 9.0 or newer, bf16);
- ``batched``: one ``bmm`` per projection over the tokens of each expert
  padded to the largest group (runs anywhere; computes the padding too);
- ``loop``: one GEMM per expert with tokens (runs anywhere; exact work, but
  one call per expert);
- ``auto``: ``grouped_mm`` where supported, otherwise ``batched`` when
  padding adds at most half the tokens, otherwise ``loop``.
"""

_MAX_BATCHED_PADDING: Final = 0.5
"""The largest fraction of padding rows for which ``auto`` picks ``batched``."""

ParameterInitializer = Callable[[Parameter], None]

RouterPrecision = Literal["activation", "fp32"]
"""
Where :class:`TopKRouter` computes its logits ``x Wᵀ``:

- ``activation``: as the surrounding computation would, in the autocast dtype
  under autocast, otherwise in the dtype of the activations and the weight;
  what transformers (``F.linear(hidden_states, weight)``) and vLLM (the gate
  is a linear layer of the model dtype) do, so a model trained in bf16 routes
  near-tied tokens in training as it will in serving;
- ``fp32``: in fp32 with autocast disabled, so that near-tied experts are
  ranked, and the load-balancing loss differentiated, at full precision, at
  the price of routing some near-tied tokens differently from serving.

The softmax over the logits is fp32 in both.
"""


@final
class TopKRouter(Module):
    """Routes each token to its ``top_k`` most probable experts.

    ``softmax(x Wᵀ)`` over all experts, the ``top_k`` largest probabilities,
    renormalised to sum to 1 (``normalize_top_k``; Qwen3.5 always does,
    Qwen3-Next configs choose). The softmax is fp32; where the logits are
    computed is ``precision`` (see :data:`RouterPrecision`): by default as
    transformers and vLLM compute them, so that a token whose experts nearly
    tie goes in training to the experts it goes to in serving.
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        top_k: int,
        *,
        normalize_top_k: bool = True,
        precision: RouterPrecision = "activation",
        init_fn: ParameterInitializer | None = None,
        device: Device | None = None,
        dtype: DataType | None = None,
    ) -> None:
        super().__init__()

        if precision not in ("activation", "fp32"):
            raise ValueError(
                f"`precision` must be 'activation' or 'fp32', but is '{precision}' instead."
            )

        if num_experts < 1:
            raise ValueError(
                f"`num_experts` must be greater than or equal to 1, but is {num_experts} instead."
            )

        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"`top_k` must be between 1 and `num_experts` ({num_experts}), but is {top_k} instead."
            )

        self.model_dim = model_dim
        self.num_experts = num_experts
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.precision = precision
        self.init_fn = init_fn

        self.weight = Parameter(
            torch.empty((num_experts, model_dim), device=device, dtype=dtype)
        )

        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.init_fn is not None:
            self.init_fn(self.weight)
        else:
            _init_uniform(self.weight, fan_in=self.model_dim)

    def forward(self, seqs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """
        :param seqs: *Shape:* :math:`(T,M)`.

        :returns:
            - The router probabilities of every expert. *Shape:* :math:`(T,E)`,
              fp32.
            - The weights of the selected experts. *Shape:* :math:`(T,K)`, fp32.
            - The indices of the selected experts, by decreasing probability.
              *Shape:* :math:`(T,K)`.
        """
        if self.precision == "fp32":
            # Under FSDP2 mixed precision the weight arrives in the parameter
            # dtype and is upcast.
            with torch.autocast(seqs.device.type, enabled=False):
                logits = F.linear(seqs.float(), self.weight.float())
        else:
            logits = F.linear(seqs, self.weight)

        probs = logits.softmax(dim=-1, dtype=torch.float32)

        top_weights, top_indices = probs.topk(self.top_k, dim=-1)

        if self.normalize_top_k:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)

        return probs, top_weights, top_indices

    @override
    def extra_repr(self) -> str:
        return (
            f"model_dim={self.model_dim}, "
            f"num_experts={self.num_experts}, "
            f"top_k={self.top_k}, "
            f"normalize_top_k={self.normalize_top_k}, "
            f"precision={self.precision}"
        )


@final
class RoutedExperts(Module, Sharded):
    """``E`` SwiGLU experts whose weights are stacked along a leading expert
    dimension, in the layout of the released checkpoints:

    - ``gate_inner_proj`` :math:`(E, 2I, M)`: the gate projection (rows
      ``[0, I)``) and the inner ("up") projection (rows ``[I, 2I)``);
    - ``output_proj`` :math:`(E, M, I)`: the output ("down") projection.

    FSDP2 shards parameters along dimension 0, so each rank holds whole
    experts. :meth:`forward` runs each expert only on the tokens routed to it.

    Under tensor parallelism each rank holds ``E / tp_size`` consecutive
    experts, from :attr:`first_local_expert` on (the parameters then have
    :attr:`num_local_experts` rows), and runs only those.
    """

    def __init__(
        self,
        num_experts: int,
        model_dim: int,
        inner_dim: int,
        *,
        dispatch: ExpertDispatch = "auto",
        init_fn: ParameterInitializer | None = None,
        gangs: Gangs | None = None,
        device: Device | None = None,
        dtype: DataType | None = None,
    ) -> None:
        super().__init__()

        if dispatch not in ("auto", "grouped_mm", "batched", "loop"):
            raise ValueError(
                f"`dispatch` must be 'auto', 'grouped_mm', 'batched', or 'loop', but is '{dispatch}' instead."
            )

        if gangs is None:
            gangs = get_current_gangs(device)

        check_tp_divisible("num_experts", num_experts, gangs.tp)

        self.num_experts = num_experts
        self.model_dim = model_dim
        self.inner_dim = inner_dim
        self.dispatch = dispatch
        self.init_fn = init_fn

        self.num_local_experts = num_experts // gangs.tp.size

        self.first_local_expert = gangs.tp.rank * self.num_local_experts

        self.gate_inner_proj = Parameter(
            torch.empty((self.num_local_experts, 2 * inner_dim, model_dim), device=device, dtype=dtype)
        )

        self.output_proj = Parameter(
            torch.empty((self.num_local_experts, model_dim, inner_dim), device=device, dtype=dtype)
        )

        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.init_fn is not None:
            self.init_fn(self.gate_inner_proj)
            self.init_fn(self.output_proj)
        else:
            _init_uniform(self.gate_inner_proj, fan_in=self.model_dim)
            _init_uniform(self.output_proj, fan_in=self.inner_dim)

    def forward(self, seqs: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """
        :param seqs: The tokens sorted by expert: the first
            ``tokens_per_expert[0]`` rows go to expert 0, and so on.
            *Shape:* :math:`(T_r,M)`.
        :param tokens_per_expert: The tokens of each of the rank's experts.
            *Shape:* :math:`(E_l,)`, summing to :math:`T_r`.

        :returns: *Shape:* Same as ``seqs``.
        """
        if self._use_grouped_mm(seqs):
            return self._forward_grouped_mm(seqs, tokens_per_expert)

        # Host integers: both fallbacks need the group bounds.
        group_sizes = tokens_per_expert.tolist()

        function: type[_BatchedSwiGLUExperts | _LoopedSwiGLUExperts]

        if self.resolve_fallback(group_sizes) == "batched":
            function = _BatchedSwiGLUExperts
        else:
            function = _LoopedSwiGLUExperts

        dtype = autocast_dtype(seqs)

        output: Tensor = function.apply(  # type: ignore[no-untyped-call]
            seqs.to(dtype),
            self.gate_inner_proj.to(dtype),
            self.output_proj.to(dtype),
            group_sizes,
        )

        return output

    def _use_grouped_mm(self, seqs: Tensor) -> bool:
        if self.dispatch in ("batched", "loop"):
            return False

        reason = self._grouped_mm_unsupported_reason(seqs)

        if reason is None:
            return True

        if self.dispatch == "grouped_mm":
            raise NotSupportedError(
                f"The `grouped_mm` expert dispatch cannot run here: {reason} Use `batched`, `loop`, or `auto` instead."
            )

        return False

    def resolve_fallback(self, group_sizes: list[int]) -> Literal["batched", "loop"]:
        """Returns the path :meth:`forward` takes where ``grouped_mm`` cannot
        run, for experts receiving ``group_sizes`` tokens."""
        if self.dispatch == "loop":
            return "loop"

        if self.dispatch == "batched":
            return "batched"

        num_padded_rows = len(group_sizes) * max(group_sizes, default=0)

        if num_padded_rows <= (1.0 + _MAX_BATCHED_PADDING) * sum(group_sizes):
            return "batched"

        return "loop"

    def _grouped_mm_unsupported_reason(self, seqs: Tensor) -> str | None:
        if not hasattr(torch, "_grouped_mm"):
            return f"PyTorch {torch.__version__} has no `torch._grouped_mm`."

        # PyTorch 2.9 runs the forward pass of `_grouped_mm` on CPU, but not
        # its backward pass.
        if seqs.device.type != "cuda":
            return f"it needs a CUDA device, but the tokens are on {seqs.device}."

        if torch.cuda.get_device_capability(seqs.device) < (9, 0):
            return "it needs a GPU of compute capability 9.0 (Hopper) or newer."

        if autocast_dtype(seqs) != torch.bfloat16:
            return f"it needs bf16 tokens, but they are {autocast_dtype(seqs)}."

        # Rows of both operands must be 16-byte aligned.
        if self.model_dim % 8 != 0 or self.inner_dim % 8 != 0:
            return f"it needs `model_dim` ({self.model_dim}) and the expert inner dimension ({self.inner_dim}) to be multiples of 8."

        return None

    def _forward_grouped_mm(self, seqs: Tensor, tokens_per_expert: Tensor) -> Tensor:
        dtype = autocast_dtype(seqs)

        # Group ends; stays on the device, so no host synchronization.
        offsets = tokens_per_expert.cumsum(0, dtype=torch.int32)

        gate_inner_proj = self.gate_inner_proj.to(dtype).transpose(-2, -1)
        output_proj = self.output_proj.to(dtype).transpose(-2, -1)

        # (T_r, M) @ (E, M, 2I) -> (T_r, 2I)
        gate_inner = torch._grouped_mm(seqs.to(dtype), gate_inner_proj, offs=offsets)

        gate, inner = gate_inner.chunk(2, dim=-1)

        # (T_r, I) @ (E, I, M) -> (T_r, M)
        return torch._grouped_mm(F.silu(gate) * inner, output_proj, offs=offsets)

    @override
    def get_shard_dims(self) -> list[tuple[Parameter, int]]:
        return [(self.gate_inner_proj, 0), (self.output_proj, 0)]

    @override
    def extra_repr(self) -> str:
        s = (
            f"num_experts={self.num_experts}, "
            f"model_dim={self.model_dim}, "
            f"inner_dim={self.inner_dim}, "
            f"dispatch={self.dispatch}"
        )

        if self.num_local_experts != self.num_experts:
            s = f"{s}, num_local_experts={self.num_local_experts}, first_local_expert={self.first_local_expert}"

        return s


class _GatherRows(torch.autograd.Function):
    """``x[index]`` where each row of ``x`` is gathered ``repeats`` times and
    ``grad_index`` inverts ``index`` (``index[grad_index]`` lists each row
    ``repeats`` times in a row).

    The backward pass is then a gather and a sum too; autograd's own, an
    index-add, is serial on CPU and not deterministic on GPU.
    """

    @staticmethod
    @autocast_free
    def forward(
        ctx: Any, x: Tensor, index: Tensor, grad_index: Tensor, repeats: int
    ) -> Tensor:
        ctx.save_for_backward(grad_index)

        ctx.repeats = repeats

        return x.index_select(0, index)

    @staticmethod
    @autocast_free
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None, None]:
        (grad_index,) = ctx.saved_tensors

        grad = grad_output.index_select(0, grad_index)

        if ctx.repeats > 1:
            # (T x K, M) -> (T, K, M) -> (T, M)
            grad = grad.view(-1, ctx.repeats, grad.size(-1)).sum(dim=1)

        return grad, None, None, None


class _LoopedSwiGLUExperts(torch.autograd.Function):
    """The SwiGLU experts on tokens sorted by expert, one GEMM per expert and
    projection, each writing into one output buffer.

    Autograd over per-expert slices would concatenate the outputs and stack
    the per-expert weight gradients, copying every activation and gradient
    once more; here the gradients of the stacked weights are written in
    place, and the elementwise SwiGLU runs once over all tokens.
    """

    @staticmethod
    @autocast_free
    def forward(
        ctx: Any,
        seqs: Tensor,
        gate_inner_proj: Tensor,
        output_proj: Tensor,
        group_sizes: list[int],
    ) -> Tensor:
        groups = _group_bounds(group_sizes)

        # (T_r, M) @ (M, 2I) per expert -> (T_r, 2I)
        gate_inner = seqs.new_empty((seqs.size(0), gate_inner_proj.size(1)))

        for expert_idx, (start, end) in groups:
            torch.mm(seqs[start:end], gate_inner_proj[expert_idx].t(), out=gate_inner[start:end])

        hidden = _swiglu(gate_inner)

        # (T_r, I) @ (I, M) per expert -> (T_r, M)
        output = seqs.new_empty((seqs.size(0), output_proj.size(1)))

        for expert_idx, (start, end) in groups:
            torch.mm(hidden[start:end], output_proj[expert_idx].t(), out=output[start:end])

        # `hidden` is recomputed from `gate_inner` in the backward pass.
        ctx.save_for_backward(seqs, gate_inner, gate_inner_proj, output_proj)

        ctx.groups = groups

        return output

    @staticmethod
    @autocast_free
    @once_differentiable
    def backward(
        ctx: Any, grad_output: Tensor
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        seqs, gate_inner, gate_inner_proj, output_proj = ctx.saved_tensors

        groups = ctx.groups

        grad_output = grad_output.contiguous()

        silu_gate, hidden = _swiglu_parts(gate_inner)

        grad_hidden = torch.empty_like(hidden)

        # Experts without tokens get zero gradients.
        grad_output_proj = torch.zeros_like(output_proj)

        for expert_idx, (start, end) in groups:
            torch.mm(grad_output[start:end], output_proj[expert_idx], out=grad_hidden[start:end])

            torch.mm(grad_output[start:end].t(), hidden[start:end], out=grad_output_proj[expert_idx])

        grad_gate_inner = _swiglu_backward(gate_inner, silu_gate, grad_hidden)

        grad_seqs = torch.empty_like(seqs)

        grad_gate_inner_proj = torch.zeros_like(gate_inner_proj)

        for expert_idx, (start, end) in groups:
            torch.mm(grad_gate_inner[start:end], gate_inner_proj[expert_idx], out=grad_seqs[start:end])

            torch.mm(grad_gate_inner[start:end].t(), seqs[start:end], out=grad_gate_inner_proj[expert_idx])

        return grad_seqs, grad_gate_inner_proj, grad_output_proj, None


class _BatchedSwiGLUExperts(torch.autograd.Function):
    """The SwiGLU experts on tokens sorted by expert, as batched GEMMs over
    the tokens of each expert padded to the largest group.

    Two ``bmm`` calls per pass instead of two GEMMs per expert: on a shared
    CPU the per-call thread synchronisation of many small GEMMs costs more
    than moderate padding. Padding rows are zero, so they add nothing to the
    weight gradients; only they are zero-filled.
    """

    @staticmethod
    @autocast_free
    def forward(
        ctx: Any,
        seqs: Tensor,
        gate_inner_proj: Tensor,
        output_proj: Tensor,
        group_sizes: list[int],
    ) -> Tensor:
        num_experts = len(group_sizes)

        capacity = max(group_sizes)

        rows, pad_rows = _padded_rows(group_sizes, capacity, seqs.device)

        # (T_r, M) -> (E, C, M)
        padded_seqs = _pad_rows(seqs, rows, pad_rows).view(num_experts, capacity, -1)

        # (E, C, M) @ (E, M, 2I) -> (E, C, 2I)
        gate_inner = torch.bmm(padded_seqs, gate_inner_proj.transpose(1, 2))

        # (E, C, I) @ (E, I, M) -> (E, C, M)
        output = torch.bmm(_swiglu(gate_inner), output_proj.transpose(1, 2))

        ctx.save_for_backward(padded_seqs, rows, pad_rows, gate_inner, gate_inner_proj, output_proj)

        # (E, C, M) -> (T_r, M)
        return output.flatten(0, 1).index_select(0, rows)

    @staticmethod
    @autocast_free
    @once_differentiable
    def backward(
        ctx: Any, grad_output: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, None]:
        padded_seqs, rows, pad_rows, gate_inner, gate_inner_proj, output_proj = ctx.saved_tensors

        # (T_r, M) -> (E, C, M)
        grad_output = _pad_rows(grad_output, rows, pad_rows).view(padded_seqs.shape)

        silu_gate, hidden = _swiglu_parts(gate_inner)

        # (E, C, M) @ (E, M, I) -> (E, C, I)
        grad_hidden = torch.bmm(grad_output, output_proj)

        # (E, M, C) @ (E, C, I) -> (E, M, I)
        grad_output_proj = torch.bmm(grad_output.transpose(1, 2), hidden)

        grad_gate_inner = _swiglu_backward(gate_inner, silu_gate, grad_hidden)

        # (E, 2I, C) @ (E, C, M) -> (E, 2I, M)
        grad_gate_inner_proj = torch.bmm(grad_gate_inner.transpose(1, 2), padded_seqs)

        # (E, C, 2I) @ (E, 2I, M) -> (E, C, M) -> (T_r, M)
        grad_seqs = torch.bmm(grad_gate_inner, gate_inner_proj).flatten(0, 1).index_select(0, rows)

        return grad_seqs, grad_gate_inner_proj, grad_output_proj, None


def _padded_rows(group_sizes: list[int], capacity: int, device: Device) -> tuple[Tensor, Tensor]:
    """Returns the row of each sorted token in the experts' groups padded to
    ``capacity`` rows each, and the padding rows."""
    sizes = torch.tensor(group_sizes, device=device)

    group_starts = sizes.cumsum(0) - sizes

    experts = torch.repeat_interleave(torch.arange(len(group_sizes), device=device), sizes)

    positions = torch.arange(experts.size(0), device=device) - group_starts[experts]

    rows = experts * capacity + positions

    is_padding = torch.ones(len(group_sizes) * capacity, dtype=torch.bool, device=device)

    is_padding[rows] = False

    return rows, is_padding.nonzero().squeeze(1)


def _pad_rows(x: Tensor, rows: Tensor, pad_rows: Tensor) -> Tensor:
    """Returns ``x`` at ``rows`` and zeros at ``pad_rows``."""
    padded = x.new_empty((rows.size(0) + pad_rows.size(0), x.size(-1)))

    padded.index_fill_(0, pad_rows, 0.0)

    return padded.index_copy_(0, rows, x)


def _swiglu(gate_inner: Tensor) -> Tensor:
    """``silu(gate) * inner``, with the gate in the first half of the last
    dimension of ``gate_inner``."""
    return _swiglu_parts(gate_inner)[1]


def _swiglu_parts(gate_inner: Tensor) -> tuple[Tensor, Tensor]:
    """Returns ``silu(gate)`` and :func:`_swiglu` of ``gate_inner``."""
    gate, inner = gate_inner.chunk(2, dim=-1)

    silu_gate = F.silu(gate)

    return silu_gate, silu_gate * inner


def _swiglu_backward(gate_inner: Tensor, silu_gate: Tensor, grad_hidden: Tensor) -> Tensor:
    """Returns the gradient of :func:`_swiglu` with respect to ``gate_inner``.

    Written into the two halves of one buffer, with the fused SiLU backward:
    on CPU these elementwise passes cost nearly as much as the GEMMs.
    """
    gate, inner = gate_inner.chunk(2, dim=-1)

    grad_gate_inner = torch.empty_like(gate_inner)

    grad_gate, grad_inner = grad_gate_inner.chunk(2, dim=-1)

    torch.ops.aten.silu_backward.grad_input(grad_hidden * inner, gate, grad_input=grad_gate)

    torch.mul(grad_hidden, silu_gate, out=grad_inner)

    return grad_gate_inner


def _group_bounds(group_sizes: list[int]) -> list[tuple[int, tuple[int, int]]]:
    """Returns ``(expert index, (start, end))`` of each expert with tokens."""
    bounds = []

    start = 0

    for expert_idx, size in enumerate(group_sizes):
        if size > 0:
            bounds.append((expert_idx, (start, start + size)))

        start += size

    return bounds


@final
@dataclass(frozen=True)
class MoeRoutingStatistics:
    """What one forward pass of a :class:`Qwen35MoeBlock` routed, counting only
    real (non-pad) tokens."""

    tokens_per_expert: Tensor
    """(token, slot) assignments to each expert. *Shape:* :math:`(E,)`, fp32."""

    router_prob_sums: Tensor
    """
    The summed router probability of each expert; differentiable, so the
    load-balancing loss trains the router. *Shape:* :math:`(E,)`, fp32.
    """

    num_tokens: Tensor
    """The number of real tokens. *Shape:* :math:`()`, fp32."""

    top_k: int
    """The number of experts each token went to."""


@final
class Qwen35MoeBlock(FeedForwardNetwork):
    """The sparse MoE feed-forward block of Qwen3.5-MoE::

        y = Σ_k w_k · expert_{e_k}(x)  +  sigmoid(shared_expert_gate(x)) · shared_expert(x)

    where :class:`TopKRouter` picks ``e_1..e_K`` and their weights ``w``.

    Tokens are dispatched by sorting their (token, slot) pairs by expert, so
    each expert computes only the tokens routed to it (never all experts on
    all tokens). Every forward pass outside activation-checkpoint
    recomputation records a :class:`MoeRoutingStatistics`, from which
    :func:`collect_moe_statistics` forms the load-balancing loss.

    Differences from fairseq2's Llama 4 ``MoE``: softmax (not sigmoid)
    routing with renormalised top-k weights applied to the expert outputs
    (not the inputs), sparse dispatch, and a sigmoid-gated shared expert.

    Under tensor parallelism the router and the shared expert gate are
    replicated, the shared expert is column/row sharded, and each rank runs
    its :class:`RoutedExperts` shard on the tokens routed to it; the ranks'
    shares of the routed output are summed. Every rank then records the same
    statistics.
    """

    def __init__(
        self,
        router: TopKRouter,
        experts: RoutedExperts,
        shared_expert: FeedForwardNetwork,
        shared_expert_gate: Module,
        *,
        gangs: Gangs | None = None,
        device: Device | None = None,
    ) -> None:
        super().__init__()

        if router.num_experts != experts.num_experts:
            raise ValueError(
                f"`router.num_experts` and `experts.num_experts` must be equal, but are {router.num_experts} and {experts.num_experts} instead."
            )

        if gangs is None:
            gangs = get_current_gangs(device)

        self.tp_gang = gangs.tp

        self.router = router
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate

        self._batch_layout: BatchLayout | None = None
        self._statistics: MoeRoutingStatistics | None = None

    @override
    def forward(self, seqs: Tensor) -> Tensor:
        """
        :param seqs: *Shape:* :math:`(N,S,M)`, or :math:`(T,M)` if packed.

        :returns: *Shape:* Same as ``seqs``.
        """
        token_mask = self._take_token_mask(seqs)

        # (N, S, M) -> (T, M)
        x = seqs.reshape(-1, seqs.size(-1))

        num_tokens = x.size(0)

        top_k = self.router.top_k

        probs, top_weights, top_indices = self.router(x)

        # Sort the (token, slot) pairs by expert; the stable sort keeps tokens
        # in order within each expert.
        # (T, K) -> (T x K)
        slot_experts = top_indices.flatten()

        sorted_slots = slot_experts.argsort(stable=True)

        # The position of each slot in the sorted order.
        slot_positions = sorted_slots.argsort()

        tokens_per_expert = torch.bincount(slot_experts, minlength=self.experts.num_experts)

        # Under tensor parallelism each rank computes its experts' share of
        # `routed`, so its gradients of `x` and of the routing weights are
        # shares too, summed over the ranks. The router runs on every rank
        # alike.
        expert_x = reduce_on_backward(x, self.tp_gang) if self.tp_gang.size > 1 else x

        # (T, M) -> (T x K, M), sorted by expert
        sorted_seqs = _GatherRows.apply(expert_x, sorted_slots // top_k, slot_positions, top_k)  # type: ignore[no-untyped-call]

        expert_outputs = self._run_local_experts(sorted_seqs, tokens_per_expert)

        # Back to (token, slot) order.
        expert_outputs = _GatherRows.apply(expert_outputs, slot_positions, sorted_slots, 1)  # type: ignore[no-untyped-call]

        top_weights = sum_gradient_over_tp(top_weights, self.tp_gang)

        # (T, 1, K) @ (T, K, M) -> (T, M)
        routed = torch.bmm(
            top_weights.to(expert_outputs.dtype).unsqueeze(1),
            expert_outputs.view(num_tokens, top_k, -1),
        ).squeeze(1)

        if self.tp_gang.size > 1:
            routed = reduce(routed, self.tp_gang)

        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

        statistics = self._routing_statistics(probs, slot_experts, token_mask)

        # Activation checkpointing reruns the forward pass during the backward
        # pass; the statistics of the original pass stand. They are computed
        # anyway, as the rerun must save the same tensors for the backward pass.
        if not _is_recomputing():
            self._statistics = statistics

        return (routed + shared).view(seqs.shape)

    def _run_local_experts(self, sorted_seqs: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """Runs the rank's experts on their rows of ``sorted_seqs``; the rows
        of the other ranks' experts are zero."""
        experts = self.experts

        if experts.num_local_experts == experts.num_experts:
            output: Tensor = experts(sorted_seqs, tokens_per_expert)

            return output

        group_sizes = tokens_per_expert.tolist()

        first, last = experts.first_local_expert, experts.first_local_expert + experts.num_local_experts

        start = sum(group_sizes[:first])
        end = start + sum(group_sizes[first:last])

        local_output: Tensor = experts(sorted_seqs[start:end], tokens_per_expert[first:last])

        # (T_l, M) -> (T x K, M)
        return F.pad(local_output, (0, 0, start, sorted_seqs.size(0) - end))

    def set_batch_layout(self, seqs_layout: BatchLayout) -> None:
        """Tells the block the layout of the batch its next forward pass
        sees, so that pad positions do not count in its statistics.

        The decoder layer passes only ``seqs`` to its feed-forward network;
        :func:`pass_batch_layout_to_ffn` calls this before each layer.
        """
        self._batch_layout = seqs_layout

    def _take_token_mask(self, seqs: Tensor) -> Tensor | None:
        seqs_layout, self._batch_layout = self._batch_layout, None

        if seqs_layout is None or not seqs_layout.padded:
            return None

        positions = seqs_layout.position_indices

        if positions.shape != seqs.shape[:-1]:
            raise ValueError(
                f"The batch layout must match `seqs`, but its positions have a shape of {tuple(positions.shape)} and `seqs` a shape of {tuple(seqs.shape)}."
            )

        # (N, S) -> (T)
        return (positions >= 0).flatten()

    def _routing_statistics(
        self, probs: Tensor, slot_experts: Tensor, token_mask: Tensor | None
    ) -> MoeRoutingStatistics:
        top_k = self.router.top_k

        num_experts = self.experts.num_experts

        if token_mask is None:
            router_prob_sums = probs.sum(dim=0)

            with torch.no_grad():
                tokens_per_expert = torch.bincount(slot_experts, minlength=num_experts).float()

                num_tokens = probs.new_tensor(float(probs.size(0)))
        else:
            token_weights = token_mask.to(probs.dtype)

            router_prob_sums = (probs * token_weights.unsqueeze(-1)).sum(dim=0)

            with torch.no_grad():
                tokens_per_expert = probs.new_zeros((num_experts,)).index_add_(
                    0, slot_experts, token_weights.repeat_interleave(top_k)
                )

                num_tokens = token_weights.sum()

        return MoeRoutingStatistics(tokens_per_expert, router_prob_sums, num_tokens, top_k)

    def pop_statistics(self) -> MoeRoutingStatistics | None:
        """Returns the statistics of the last forward pass and forgets them,
        or ``None`` if there was no forward pass since the last call."""
        statistics, self._statistics = self._statistics, None

        return statistics


def pass_batch_layout_to_ffn(
    layer: Module, args: tuple[object, ...], kwargs: Mapping[str, object]
) -> None:
    """A forward pre-hook for decoder layers whose ``ffn`` is a
    :class:`Qwen35MoeBlock`: hands the block the layer's batch layout.

    A module-level function, not a closure, so that copies of the model
    (``deepcopy``, pickling) keep working hooks.
    """
    seqs_layout = args[1] if len(args) > 1 else kwargs.get("seqs_layout")

    if not isinstance(seqs_layout, BatchLayout):
        raise TypeError(
            f"The second argument of the decoder layer must be a `BatchLayout`, but is of type `{type(seqs_layout).__name__}` instead."
        )

    ffn = layer.ffn

    if not isinstance(ffn, Qwen35MoeBlock):
        raise TypeError(
            f"`layer.ffn` must be a `Qwen35MoeBlock`, but is of type `{type(ffn).__name__}` instead."
        )

    ffn.set_batch_layout(seqs_layout)


@final
@dataclass(frozen=True)
class MoeStatistics:
    """The routing of one forward pass of a model, over all its MoE layers."""

    load_balancing_loss: Tensor
    """
    The Switch Transformer auxiliary loss exactly as transformers'
    ``load_balancing_loss_func`` computes it: all layers' real tokens are
    pooled, so with :math:`N` = layers × tokens, :math:`C_e` the top-k
    assignments and :math:`P_e` the summed router probabilities of expert
    :math:`e`, it is :math:`E \\sum_e (C_e / N) (P_e / N)` (1 when perfectly
    balanced with ``top_k`` 1). Unscaled; differentiable. *Shape:* :math:`()`.

    The probabilities are the softmax of the router logits, as in
    transformers 5.24; in 5.2.0 the Qwen3.5-MoE router handed its
    probabilities to the loss as logits, which applied the softmax twice.
    """

    tokens_per_expert: Tensor
    """
    The (token, slot) assignments of real tokens to each expert of each MoE
    layer. *Shape:* :math:`(L,E)`, fp32.
    """

    num_tokens: Tensor
    """The number of real tokens each layer routed. *Shape:* :math:`()`."""

    top_k: int
    """The number of experts each token went to."""

    @property
    def max_tokens_per_expert(self) -> Tensor:
        """The heaviest load of any expert in any layer."""
        return self.tokens_per_expert.max()

    @property
    def min_tokens_per_expert(self) -> Tensor:
        """The lightest load of any expert in any layer."""
        return self.tokens_per_expert.min()

    @property
    def num_dropped_assignments(self) -> Tensor:
        """The (token, slot) assignments that no expert computed; 0, as the
        experts have no capacity limit."""
        num_layers = self.tokens_per_expert.size(0)

        return self.num_tokens * self.top_k * num_layers - self.tokens_per_expert.sum()


def collect_moe_statistics(model: Module) -> MoeStatistics | None:
    """Combines and clears the statistics that the MoE blocks of ``model``
    recorded in its last forward pass.

    Works through activation-checkpoint, FSDP, DDP, and ``torch.compile``
    wrappers. Call it after every forward pass whose load-balancing loss
    counts (every gradient-accumulation step), before the backward pass.

    :returns: ``None`` if ``model`` has no MoE layers.

    :raises RuntimeError: if an MoE layer has no statistics, that is, no
        forward pass ran since the last call.
    """
    blocks = [m for m in model.modules() if isinstance(m, Qwen35MoeBlock)]

    if not blocks:
        return None

    layer_statistics = [block.pop_statistics() for block in blocks]

    missing = [idx for idx, s in enumerate(layer_statistics) if s is None]

    if missing:
        raise RuntimeError(
            f"MoE layers {missing} have no routing statistics. Run a forward pass of the model before collecting them, and collect them once per forward pass."
        )

    statistics = [s for s in layer_statistics if s is not None]

    top_k = statistics[0].top_k

    if any(s.top_k != top_k for s in statistics):
        raise ValueError(
            "The MoE layers must route each token to the same number of experts to combine their statistics, but do not."
        )

    tokens_per_expert = torch.stack([s.tokens_per_expert for s in statistics])

    router_prob_sums = torch.stack([s.router_prob_sums for s in statistics]).sum(dim=0)

    num_tokens = statistics[0].num_tokens

    # N = layers × tokens, clamped so that a batch of pads gives 0, not NaN.
    total = (num_tokens * len(statistics)).clamp(min=1.0)

    num_experts = tokens_per_expert.size(1)

    load_balancing_loss = num_experts * torch.sum(
        (tokens_per_expert.sum(dim=0) / total) * (router_prob_sums / total)
    )

    return MoeStatistics(load_balancing_loss, tokens_per_expert, num_tokens, top_k)


def _is_recomputing() -> bool:
    """Returns ``True`` inside the autograd engine, where activation
    checkpointing recomputes forward passes."""
    return torch._C._current_graph_task_id() != -1


def _init_uniform(weight: Tensor, *, fan_in: int) -> None:
    """Initializes ``weight`` as :class:`torch.nn.Linear` does its weight."""
    bound = fan_in**-0.5

    torch.nn.init.uniform_(weight, -bound, bound)
