"""The routed experts of the Qwen3.5-MoE block: ``E`` SwiGLU experts with
stacked weights, each run on the tokens routed to it."""

from __future__ import annotations

from typing import Any, Final, Literal, final

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.nn import Module, ModuleDict, Parameter
from typing_extensions import override

from fairseq2.data_type import DataType
from fairseq2.device import Device
from fairseq2.error import NotSupportedError
from fairseq2.gang import Gangs, get_current_gangs
from fairseq2.nn.sharded import Sharded

from qwen35_fs2.nn.moe.router import ParameterInitializer, init_uniform
from qwen35_fs2.nn.tp import check_tp_divisible
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
- ``auto``: ``grouped_mm`` where supported; on CPU ``loop``, whose
  per-call cost is small there against padding and the padding's copies
  (a training step of the MoE reference config 5% shorter than with
  ``batched``; docs/performance.md); on GPUs without ``grouped_mm``, where
  every call is a kernel launch, ``batched`` when padding adds at most half
  the tokens, otherwise ``loop``.
"""

_MAX_BATCHED_PADDING: Final = 0.5
"""The largest fraction of padding rows for which ``auto`` picks ``batched``
(on GPUs without ``grouped_mm``)."""


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

    LoRA adapters on the stacked weights (:attr:`lora`, by weight name, put
    by :func:`~qwen35_fs2.nn.lora.add_expert_lora_adapter`) update them
    before they are used.
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

        self.expert_ids: tuple[int, ...] = tuple(range(self.first_local_expert, self.first_local_expert + self.num_local_experts))
        """The experts whose weights the rows of the parameters hold, in
        order; expert parallelism keeps some of the rank's and reorders
        them."""

        self.gate_inner_proj = Parameter(
            torch.empty((self.num_local_experts, 2 * inner_dim, model_dim), device=device, dtype=dtype)
        )

        self.output_proj = Parameter(
            torch.empty((self.num_local_experts, model_dim, inner_dim), device=device, dtype=dtype)
        )

        self.lora: ModuleDict | None

        self.register_module("lora", None)

        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initializes the weights expert by expert: every expert of the
        model is drawn in turn and this module keeps those it holds
        (:attr:`expert_ids`), so that tensor- and expert-parallel ranks,
        which fairseq2 seeds alike, hold the experts of the unsharded model
        of the same seed and not copies of one another's; one expert's
        weight at a time is drawn beyond the module's own."""
        rows = {expert: row for row, expert in enumerate(self.expert_ids)}

        for weight, fan_in in ((self.gate_inner_proj, self.model_dim), (self.output_proj, self.inner_dim)):
            # Nothing to draw (a 397B model has 60 layers of 512 experts).
            if weight.is_meta:
                continue

            drawn = torch.empty(weight.shape[1:], device=weight.device, dtype=weight.dtype)

            for expert in range(self.num_experts):
                if self.init_fn is not None:
                    self.init_fn(drawn)
                else:
                    init_uniform(drawn, fan_in=fan_in)

                row = rows.get(expert)

                if row is not None:
                    with torch.no_grad():
                        weight[row].copy_(drawn)

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

        dtype = autocast_dtype(seqs)

        seqs = seqs.to(dtype)

        gate_inner_proj = self._weight("gate_inner_proj").to(dtype)
        output_proj = self._weight("output_proj").to(dtype)

        # Both fallbacks need the group bounds as host integers, which a
        # traced graph cannot hold: compiled, the experts run as one opaque
        # operator that reads them itself.
        if torch.compiler.is_compiling():
            output, _ = torch.ops.qwen35_fs2.swiglu_experts(
                seqs, gate_inner_proj, output_proj, tokens_per_expert, self.dispatch
            )

            return output  # type: ignore[no-any-return]

        group_sizes = tokens_per_expert.tolist()

        function: type[_BatchedSwiGLUExperts | _LoopedSwiGLUExperts]

        if self.resolve_fallback(group_sizes, seqs.device) == "batched":
            function = _BatchedSwiGLUExperts
        else:
            function = _LoopedSwiGLUExperts

        output = function.apply(seqs, gate_inner_proj, output_proj, group_sizes)  # type: ignore[no-untyped-call]

        return output  # type: ignore[no-any-return]

    def _weight(self, name: str) -> Tensor:
        """Returns the stacked weight ``name``, updated by its LoRA adapter
        if it has one."""
        weight: Tensor = getattr(self, name)

        if self.lora is not None and name in self.lora:
            weight = self.lora[name](weight)

        return weight

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

    def resolve_fallback(self, group_sizes: list[int], device: Device) -> Literal["batched", "loop"]:
        """Returns the path :meth:`forward` takes where ``grouped_mm`` cannot
        run, for experts receiving ``group_sizes`` tokens on ``device``."""
        return _resolve_fallback(self.dispatch, group_sizes, device)

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

        gate_inner_proj = self._weight("gate_inner_proj").to(dtype).transpose(-2, -1)
        output_proj = self._weight("output_proj").to(dtype).transpose(-2, -1)

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


def _resolve_fallback(dispatch: str, group_sizes: list[int], device: Device) -> Literal["batched", "loop"]:
    # No token at all (a rank whose experts were routed none, as happens
    # under expert and tensor parallelism): groups padded to a capacity of 0
    # cannot be batched, and the loop runs no GEMM and gives zero gradients.
    if dispatch == "loop" or (dispatch == "auto" and device.type == "cpu") or sum(group_sizes) == 0:
        return "loop"

    if dispatch == "batched":
        return "batched"

    num_padded_rows = len(group_sizes) * max(group_sizes, default=0)

    if num_padded_rows <= (1.0 + _MAX_BATCHED_PADDING) * sum(group_sizes):
        return "batched"

    return "loop"


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

        output, gate_inner = _looped_forward(seqs, gate_inner_proj, output_proj, groups)

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
        grads = _looped_backward(grad_output, *ctx.saved_tensors, ctx.groups)

        return *grads, None


def _looped_forward(
    seqs: Tensor,
    gate_inner_proj: Tensor,
    output_proj: Tensor,
    groups: list[tuple[int, tuple[int, int]]],
) -> tuple[Tensor, Tensor]:
    """Returns the output and the gate/inner pre-activations ``(T_r, 2I)``."""
    # (T_r, M) @ (M, 2I) per expert -> (T_r, 2I)
    gate_inner = seqs.new_empty((seqs.size(0), gate_inner_proj.size(1)))

    for expert_idx, (start, end) in groups:
        torch.mm(seqs[start:end], gate_inner_proj[expert_idx].t(), out=gate_inner[start:end])

    hidden = _swiglu(gate_inner)

    # (T_r, I) @ (I, M) per expert -> (T_r, M)
    output = seqs.new_empty((seqs.size(0), output_proj.size(1)))

    for expert_idx, (start, end) in groups:
        torch.mm(hidden[start:end], output_proj[expert_idx].t(), out=output[start:end])

    return output, gate_inner


def _looped_backward(
    grad_output: Tensor,
    seqs: Tensor,
    gate_inner: Tensor,
    gate_inner_proj: Tensor,
    output_proj: Tensor,
    groups: list[tuple[int, tuple[int, int]]],
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns the gradients of ``seqs`` and of the stacked weights."""
    grad_output = grad_output.contiguous()

    silu_gate, hidden = _swiglu_parts(gate_inner)

    grad_hidden = torch.empty_like(hidden)

    grad_output_proj = _stacked_weight_grad(output_proj, groups)

    for expert_idx, (start, end) in groups:
        torch.mm(grad_output[start:end], output_proj[expert_idx], out=grad_hidden[start:end])

        torch.mm(grad_output[start:end].t(), hidden[start:end], out=grad_output_proj[expert_idx])

    grad_gate_inner = _swiglu_backward(gate_inner, silu_gate, grad_hidden)

    grad_seqs = torch.empty_like(seqs)

    grad_gate_inner_proj = _stacked_weight_grad(gate_inner_proj, groups)

    for expert_idx, (start, end) in groups:
        torch.mm(grad_gate_inner[start:end], gate_inner_proj[expert_idx], out=grad_seqs[start:end])

        torch.mm(grad_gate_inner[start:end].t(), seqs[start:end], out=grad_gate_inner_proj[expert_idx])

    return grad_seqs, grad_gate_inner_proj, grad_output_proj


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
        rows, pad_rows = _padded_rows(group_sizes, seqs.device)

        # (T_r, M) -> (E, C, M)
        padded_seqs = _pad_rows(seqs, rows, pad_rows, len(group_sizes))

        output, gate_inner = _batched_forward(padded_seqs, gate_inner_proj, output_proj)

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
        grad_output = _pad_rows(grad_output, rows, pad_rows, padded_seqs.size(0))

        grad_seqs, grad_gate_inner_proj, grad_output_proj = _batched_backward(
            grad_output, padded_seqs, gate_inner, gate_inner_proj, output_proj
        )

        # (E, C, M) -> (T_r, M)
        grad_seqs = grad_seqs.flatten(0, 1).index_select(0, rows)

        return grad_seqs, grad_gate_inner_proj, grad_output_proj, None


def _batched_forward(
    padded_seqs: Tensor, gate_inner_proj: Tensor, output_proj: Tensor
) -> tuple[Tensor, Tensor]:
    """Returns the output ``(E, C, M)`` and the gate/inner pre-activations
    ``(E, C, 2I)`` of the padded groups."""
    # (E, C, M) @ (E, M, 2I) -> (E, C, 2I)
    gate_inner = torch.bmm(padded_seqs, gate_inner_proj.transpose(1, 2))

    # (E, C, I) @ (E, I, M) -> (E, C, M)
    output = torch.bmm(_swiglu(gate_inner), output_proj.transpose(1, 2))

    return output, gate_inner


def _batched_backward(
    grad_output: Tensor,
    padded_seqs: Tensor,
    gate_inner: Tensor,
    gate_inner_proj: Tensor,
    output_proj: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns the gradients of the padded groups ``(E, C, M)`` and of the
    stacked weights."""
    silu_gate, hidden = _swiglu_parts(gate_inner)

    # (E, C, M) @ (E, M, I) -> (E, C, I)
    grad_hidden = torch.bmm(grad_output, output_proj)

    # (E, M, C) @ (E, C, I) -> (E, M, I)
    grad_output_proj = torch.bmm(grad_output.transpose(1, 2), hidden)

    grad_gate_inner = _swiglu_backward(gate_inner, silu_gate, grad_hidden)

    # (E, 2I, C) @ (E, C, M) -> (E, 2I, M)
    grad_gate_inner_proj = torch.bmm(grad_gate_inner.transpose(1, 2), padded_seqs)

    # (E, C, 2I) @ (E, 2I, M) -> (E, C, M)
    grad_seqs = torch.bmm(grad_gate_inner, gate_inner_proj)

    return grad_seqs, grad_gate_inner_proj, grad_output_proj


@torch.library.custom_op("qwen35_fs2::swiglu_experts", mutates_args=())
@autocast_free
def _swiglu_experts(
    seqs: Tensor,
    gate_inner_proj: Tensor,
    output_proj: Tensor,
    tokens_per_expert: Tensor,
    dispatch: str,
) -> tuple[Tensor, Tensor]:
    """The fallbacks of :meth:`RoutedExperts.forward` as one operator, for
    ``torch.compile``: it reads the group sizes on the host itself, where a
    traced graph cannot.

    :returns: The output ``(T_r, M)`` and the gate/inner pre-activations
        ``(T_r, 2I)``, which the backward pass needs.
    """
    group_sizes = tokens_per_expert.tolist()

    if _resolve_fallback(dispatch, group_sizes, seqs.device) == "loop":
        return _looped_forward(seqs, gate_inner_proj, output_proj, _group_bounds(group_sizes))

    rows, pad_rows = _padded_rows(group_sizes, seqs.device)

    padded_seqs = _pad_rows(seqs, rows, pad_rows, len(group_sizes))

    output, gate_inner = _batched_forward(padded_seqs, gate_inner_proj, output_proj)

    return output.flatten(0, 1).index_select(0, rows), gate_inner.flatten(0, 1).index_select(0, rows)


@_swiglu_experts.register_fake
def _(
    seqs: Tensor,
    gate_inner_proj: Tensor,
    output_proj: Tensor,
    tokens_per_expert: Tensor,
    dispatch: str,
) -> tuple[Tensor, Tensor]:
    num_rows = seqs.size(0)

    return seqs.new_empty((num_rows, output_proj.size(1))), seqs.new_empty((num_rows, gate_inner_proj.size(1)))


@torch.library.custom_op("qwen35_fs2::swiglu_experts_backward", mutates_args=())
@autocast_free
def _swiglu_experts_backward(
    grad_output: Tensor,
    seqs: Tensor,
    gate_inner: Tensor,
    gate_inner_proj: Tensor,
    output_proj: Tensor,
    tokens_per_expert: Tensor,
    dispatch: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward pass of ``qwen35_fs2::swiglu_experts``: the gradients of
    ``seqs`` and of the stacked weights."""
    group_sizes = tokens_per_expert.tolist()

    if _resolve_fallback(dispatch, group_sizes, seqs.device) == "loop":
        return _looped_backward(
            grad_output, seqs, gate_inner, gate_inner_proj, output_proj, _group_bounds(group_sizes)
        )

    rows, pad_rows = _padded_rows(group_sizes, seqs.device)

    num_experts = len(group_sizes)

    grad_seqs, grad_gate_inner_proj, grad_output_proj = _batched_backward(
        _pad_rows(grad_output, rows, pad_rows, num_experts),
        _pad_rows(seqs, rows, pad_rows, num_experts),
        _pad_rows(gate_inner, rows, pad_rows, num_experts),
        gate_inner_proj,
        output_proj,
    )

    return grad_seqs.flatten(0, 1).index_select(0, rows), grad_gate_inner_proj, grad_output_proj


@_swiglu_experts_backward.register_fake
def _(
    grad_output: Tensor,
    seqs: Tensor,
    gate_inner: Tensor,
    gate_inner_proj: Tensor,
    output_proj: Tensor,
    tokens_per_expert: Tensor,
    dispatch: str,
) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(seqs), torch.empty_like(gate_inner_proj), torch.empty_like(output_proj)


def _setup_swiglu_experts_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    seqs, gate_inner_proj, output_proj, tokens_per_expert, dispatch = inputs

    _, gate_inner = output

    # An intermediate kept for the backward pass, not a result.
    ctx.mark_non_differentiable(gate_inner)

    ctx.save_for_backward(seqs, gate_inner, gate_inner_proj, output_proj, tokens_per_expert)

    ctx.dispatch = dispatch


def _swiglu_experts_autograd(ctx: Any, grad_output: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:
    grads = torch.ops.qwen35_fs2.swiglu_experts_backward(
        grad_output, *ctx.saved_tensors, ctx.dispatch
    )

    return *grads, None, None


_swiglu_experts.register_autograd(
    _swiglu_experts_autograd, setup_context=_setup_swiglu_experts_context
)


def _padded_rows(group_sizes: list[int], device: Device) -> tuple[Tensor, Tensor]:
    """Returns the row of each sorted token in the experts' groups padded to
    the largest group, and the padding rows."""
    capacity = max(group_sizes)

    sizes = torch.tensor(group_sizes, device=device)

    group_starts = sizes.cumsum(0) - sizes

    experts = torch.repeat_interleave(torch.arange(len(group_sizes), device=device), sizes)

    positions = torch.arange(experts.size(0), device=device) - group_starts[experts]

    rows = experts * capacity + positions

    is_padding = torch.ones(len(group_sizes) * capacity, dtype=torch.bool, device=device)

    is_padding[rows] = False

    return rows, is_padding.nonzero().squeeze(1)


def _pad_rows(x: Tensor, rows: Tensor, pad_rows: Tensor, num_experts: int) -> Tensor:
    """Returns ``x`` ``(T_r, F)`` at ``rows`` and zeros at ``pad_rows``, as
    groups ``(E, C, F)``."""
    num_rows = rows.size(0) + pad_rows.size(0)

    padded = x.new_empty((num_rows, x.size(-1)))

    padded.index_fill_(0, pad_rows, 0.0)

    return padded.index_copy_(0, rows, x).view(num_experts, num_rows // num_experts, -1)


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


def _stacked_weight_grad(weight: Tensor, groups: list[tuple[int, tuple[int, int]]]) -> Tensor:
    """Returns an uninitialized gradient of the stacked ``weight`` whose
    experts without tokens are zero; the loop writes the others whole.

    Zero-filling all of it wrote each expert's weight gradient twice (the
    fills were 3% of the MoE reference step's profile on CPU, most of it the
    first touch of fresh pages, which the GEMMs now pay; docs/performance.md).
    """
    grad = torch.empty_like(weight)

    with_tokens = {expert_idx for expert_idx, _ in groups}

    for expert_idx in range(weight.size(0)):
        if expert_idx not in with_tokens:
            grad[expert_idx].zero_()

    return grad


def _group_bounds(group_sizes: list[int]) -> list[tuple[int, tuple[int, int]]]:
    """Returns ``(expert index, (start, end))`` of each expert with tokens."""
    bounds = []

    start = 0

    for expert_idx, size in enumerate(group_sizes):
        if size > 0:
            bounds.append((expert_idx, (start, start + size)))

        start += size

    return bounds
