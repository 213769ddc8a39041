"""Depthwise causal 1-D convolution that restarts at document boundaries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, final

import torch
import torch.nn.functional as F
from torch import Tensor

from qwen35_fs2.ops.autocast import autocast_free
from qwen35_fs2.ops.backend import GdnBackend
from qwen35_fs2.ops.delta_rule.common import sequence_lengths
from qwen35_fs2.ops.fla_kernels import fla_causal_conv1d
from qwen35_fs2.ops.varlen import VarlenMetadata


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    *,
    activation: Literal["silu"] | None = "silu",
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | VarlenMetadata | None = None,
    backend: GdnBackend = "torch",
) -> tuple[Tensor, Tensor | None]:
    """Convolves every channel of ``x`` with its own causal kernel.

    ``y[t] = sum_j weight[:, j] * x[t - (W - 1) + j]``, where inputs before
    the start of a sequence come from ``initial_state`` (zeros if ``None``).

    The PyTorch path keeps only its input for the backward (it recomputes
    the pre-activation). Given as a tensor, ``cu_seqlens`` is read on the host
    (a device synchronization); given as :class:`VarlenMetadata`, its host
    copy is used and the gather indices are built once per metadata. Under
    ``torch.compile``, a packed batch runs as the operator
    ``qwen35_fs2::packed_causal_conv1d`` (:mod:`~qwen35_fs2.ops.packed_ops`),
    so that the graph does not specialize on the documents' lengths.

    :param x: The input of shape ``[B, T, D]``.
    :param weight: The kernels of shape ``[D, W]``.
    :param activation: Applied to the output.
    :param initial_state: The ``W - 1`` inputs preceding each sequence, of
        shape ``[N, D, W - 1]``.
    :param output_final_state: If ``True``, also returns the last ``W - 1``
        inputs of each sequence (what a following call needs as its state).
    :param cu_seqlens: Cumulative document lengths ``[N + 1]`` of a packed
        batch (``B`` must be 1); the receptive field never crosses a document
        start.
    :param backend: ``fla`` runs Dao-AILab's ``causal_conv1d`` (if installed
        and no state is involved) or fla's Triton kernel; CUDA only.

    :returns: The output of shape ``[B, T, D]`` and, if requested, the final
        states of shape ``[N, D, W - 1]``.
    """
    batch_size, seq_len, dim = x.shape

    if weight.ndim != 2 or weight.size(0) != dim:
        raise ValueError(
            f"`weight` must be of shape [D={dim}, W], but is {tuple(weight.shape)} instead."
        )

    width = weight.size(1)

    if activation not in ("silu", None):
        raise ValueError(
            f"`activation` must be 'silu' or `None`, but is '{activation}' instead."
        )

    if cu_seqlens is not None and batch_size != 1:
        raise ValueError(
            f"The batch size must be 1 when `cu_seqlens` is given, but is {batch_size} instead."
        )

    varlen = None if cu_seqlens is None else VarlenMetadata.of(cu_seqlens)

    num_seqs = batch_size if varlen is None else varlen.num_seqs

    state_shape = (num_seqs, dim, width - 1)

    if initial_state is not None and initial_state.shape != state_shape:
        raise ValueError(
            f"`initial_state` must be of shape [N, D, W - 1] = {state_shape}, but is {tuple(initial_state.shape)} instead."
        )

    # Under `torch.compile`, the lengths are checked by the operators that
    # run the kernels: reading them here would specialize the graph on them.
    if varlen is not None and not torch.compiler.is_compiling():
        sequence_lengths(batch_size, seq_len, varlen)

    if backend == "fla":
        return fla_causal_conv1d(
            x,
            weight,
            activation=activation,
            initial_state=initial_state,
            output_final_state=output_final_state,
            varlen=varlen,
        )

    if backend != "torch":
        raise ValueError(f"`backend` must be 'torch' or 'fla', but is '{backend}' instead.")

    if varlen is None:
        layout = _HistoryLayout.regular(seq_len, width)
    elif torch.compiler.is_compiling():
        # Imported here: the operator runs this module's kernel.
        from qwen35_fs2.ops.packed_ops import packed_causal_conv1d

        y, final_state = packed_causal_conv1d(
            x, weight, initial_state, varlen.cu_seqlens_cpu, activation == "silu", output_final_state
        )

        return y, final_state if output_final_state else None
    else:
        layout = varlen.derived(
            ("conv_history", width, x.device),
            lambda: _HistoryLayout.packed(list(varlen.lengths), width, x.device),
        )

    y, final_state = _CausalConv1dFunction.apply(  # type: ignore[no-untyped-call]
        x, weight, initial_state, activation == "silu", output_final_state, layout
    )

    return y, final_state


@final
@dataclass(frozen=True)
class _HistoryLayout:
    """Lays every sequence out after its ``W - 1`` state rows, in a history
    of shape ``[B', R, D]``: then ``pre[:, r] = sum_j w_j * history[:, r +
    j]``, without any masking.

    A regular batch is ``[B, W - 1 + T, D]``; a packed one is one row of
    ``R = N (W - 1) + T`` whose gathers are given by index tensors.
    """

    width: int

    num_rows: int

    token_rows: Tensor | None
    """``[T]``: the history row of every token; ``None`` for a regular batch."""

    state_rows: Tensor | None
    """``[N, W - 1]``: the history rows of the initial states."""

    final_rows: Tensor | None
    """``[N, W - 1]``: the history rows of the final states."""

    @staticmethod
    def regular(seq_len: int, width: int) -> _HistoryLayout:
        return _HistoryLayout(width, width - 1 + seq_len, None, None, None)

    @staticmethod
    def packed(lengths: list[int], width: int, device: torch.device) -> _HistoryLayout:
        num_seqs, num_tokens = len(lengths), sum(lengths)

        lengths_pt = torch.tensor(lengths, device=device, dtype=torch.int64)

        seq_ends = lengths_pt.cumsum(0) + (width - 1) * torch.arange(1, num_seqs + 1, device=device)

        token_seqs = torch.repeat_interleave(
            torch.arange(num_seqs, device=device), lengths_pt, output_size=num_tokens
        )

        token_rows = torch.arange(num_tokens, device=device) + (width - 1) * (token_seqs + 1)

        slots = torch.arange(width - 1, device=device)

        state_rows = (seq_ends - lengths_pt - (width - 1))[:, None] + slots
        final_rows = (seq_ends - (width - 1))[:, None] + slots

        return _HistoryLayout(
            width, num_tokens + num_seqs * (width - 1), token_rows, state_rows, final_rows
        )

    def build(self, x: Tensor, state: Tensor | None) -> Tensor:
        """Returns the history of ``x`` ``[B, T, D]`` and ``state`` ``[N, D,
        W - 1]`` (zeros if ``None``)."""
        batch_size, _, dim = x.shape

        if self.token_rows is None:
            if state is None:
                state = x.new_zeros((batch_size, dim, self.width - 1))

            return torch.cat([state.transpose(1, 2).to(x.dtype), x], dim=1)

        assert self.state_rows is not None

        history = x.new_zeros((self.num_rows, dim))

        history.index_copy_(0, self.token_rows, x[0])

        if state is not None:
            history.index_copy_(0, self.state_rows.flatten(), state.transpose(1, 2).flatten(0, 1).to(x.dtype))

        return history[None]

    def tokens(self, history_like: Tensor) -> Tensor:
        """The rows of the tokens, ``[B, T, D]``."""
        if self.token_rows is None:
            return history_like[:, self.width - 1 :]

        return history_like[:, self.token_rows]

    def states(self, history_like: Tensor, final: bool) -> Tensor:
        """The rows of the initial (or final) states, ``[N, D, W - 1]``."""
        if self.token_rows is None:
            begin = history_like.size(1) - (self.width - 1) if final else 0

            rows = history_like[:, begin : begin + self.width - 1]

            return rows.transpose(1, 2)

        rows_idx = self.final_rows if final else self.state_rows

        assert rows_idx is not None

        return history_like[0, rows_idx].transpose(1, 2)

    def outputs(self, pre: Tensor) -> Tensor:
        """``pre`` ``[B', R - (W - 1), D]`` at the rows of the tokens."""
        if self.token_rows is None:
            return pre

        return pre[:, self.token_rows - (self.width - 1)]

    def scatter_outputs(self, dy: Tensor) -> Tensor:
        """The transpose of :meth:`outputs` (``dy`` itself for a regular
        batch)."""
        if self.token_rows is None:
            return dy

        dpre = dy.new_zeros((1, self.num_rows - (self.width - 1), dy.size(-1)))

        dpre[0].index_copy_(0, self.token_rows - (self.width - 1), dy[0])

        return dpre

    def add_to_final_states(self, dhistory: Tensor, dht: Tensor) -> None:
        """Adds ``dht`` ``[N, D, W - 1]`` to the final state rows of
        ``dhistory``."""
        dht = dht.to(dhistory.dtype).transpose(1, 2)

        if self.final_rows is None:
            dhistory[:, dhistory.size(1) - (self.width - 1) :] += dht
        else:
            dhistory[0].index_add_(0, self.final_rows.flatten(), dht.flatten(0, 1))


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16 and fp16 inputs, as cuDNN's and oneDNN's convolutions
    (the reference's ``nn.Conv1d``) and fla's kernels accumulate: summed in
    bf16, the four taps' products rounded four times, and the output was two
    to three times as far from the exact convolution."""
    return torch.promote_types(dtype, torch.float32)


def _convolve(history: Tensor, taps: Tensor) -> Tensor:
    """``pre[:, r] = sum_j taps[j] * history[:, r + j]``, summed and returned
    in :func:`_accumulation_dtype` (the products of bf16 values are exact in
    fp32).

    :param taps: The kernels as ``[W, D]``, a contiguous row per tap: a
        strided column of the ``[D, W]`` weight makes every eager
        multiply-add a non-vectorized loop (five times slower on CPU).
    """
    width = taps.size(0)

    num_rows = history.size(1) - (width - 1)

    dtype = _accumulation_dtype(history.dtype)

    # Not `torch.mul(..., out=pre)`, which multiplies in the inputs' dtype;
    # `addcmul_` computes in its fp32 output's.
    pre = history[:, width - 1 :].to(dtype) * taps[width - 1].to(dtype)

    for j in range(width - 1):
        pre.addcmul_(history[:, j : j + num_rows], taps[j])

    return pre


@torch.library.custom_op("qwen35_fs2::conv_taps", mutates_args=())
def conv_taps(weight: Tensor, dtype: torch.dtype) -> Tensor:
    """The ``[D, W]`` weight as :func:`_convolve`'s ``[W, D]`` taps in
    ``dtype``.

    An operator, opaque to inductor: under ``torch.compile`` inductor inlines
    a plain ``t().contiguous()`` into the loops that read the taps, which then
    read the weight's columns with a stride of ``W`` and are emitted as scalar
    code on CPU (the convolution's recomputation in the backward pass, with
    its SiLU, among them); the operator's output is a buffer of its own, read
    row by row (docs/performance.md, "Ninth session").
    """
    return weight.to(dtype).t().contiguous()


@conv_taps.register_fake
def _(weight: Tensor, dtype: torch.dtype) -> Tensor:
    return weight.new_empty((weight.size(1), weight.size(0)), dtype=dtype)


def _conv_taps_setup_context(ctx: Any, inputs: tuple[Tensor, torch.dtype], output: Tensor) -> None:
    ctx.weight_dtype = inputs[0].dtype


def _conv_taps_backward(ctx: Any, dtaps: Tensor) -> tuple[Tensor, None]:
    return dtaps.t().to(ctx.weight_dtype), None


conv_taps.register_autograd(_conv_taps_backward, setup_context=_conv_taps_setup_context)


@autocast_free
def conv_forward(
    x: Tensor,
    weight: Tensor,
    initial_state: Tensor | None,
    silu: bool,
    output_final_state: bool,
    layout: _HistoryLayout,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """The forward pass of :func:`causal_conv1d`'s PyTorch path over
    ``layout``.

    :returns: The output, the final states (or ``None``), and the history
        that :func:`conv_backward` needs.
    """
    history = layout.build(x, initial_state)

    pre = _convolve(history, conv_taps(weight, x.dtype))

    y = layout.outputs((F.silu(pre, inplace=True) if silu else pre).to(x.dtype))

    final_state = layout.states(history, final=True).contiguous() if output_final_state else None

    return y.reshape(x.shape), final_state, history


@autocast_free
def conv_backward(
    history: Tensor,
    weight: Tensor,
    dy: Tensor,
    dht: Tensor | None,
    silu: bool,
    layout: _HistoryLayout,
    state_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The backward pass of :func:`conv_forward`, which recomputes the
    pre-activation from ``history``.

    :param state_dtype: The dtype of the initial states, ``None`` if there
        were none (then their gradient is ``None``).

    :returns: The gradients of the input, the weight and the initial
        states.
    """
    taps = conv_taps(weight, history.dtype)

    # The gradient of the pre-activation, over all rows of the history (the
    # state rows get none), and the sums below in the dtype of the forward
    # pass's.
    dtype = _accumulation_dtype(history.dtype)

    dpre = layout.scatter_outputs(dy).to(dtype)

    if silu:
        dpre = torch.ops.aten.silu_backward(dpre, _convolve(history, taps))

    num_rows = dpre.size(1)

    dhistory = torch.zeros_like(history, dtype=dtype)

    # `[W, D]`, as the taps.
    dtaps = torch.empty_like(taps, dtype=dtype)

    product = torch.empty_like(dpre)

    for j in range(taps.size(0)):
        window = history[:, j : j + num_rows]

        dhistory[:, j : j + num_rows].addcmul_(dpre, taps[j])

        dtaps[j] = torch.mul(dpre, window, out=product).sum((0, 1))

    if dht is not None:
        layout.add_to_final_states(dhistory, dht)

    dx = layout.tokens(dhistory).reshape(dy.shape).to(history.dtype)

    dh0 = None

    if state_dtype is not None:
        dh0 = layout.states(dhistory, final=False).to(state_dtype)

    return dx, dtaps.to(weight.dtype).t().contiguous(), dh0


class _CausalConv1dFunction(torch.autograd.Function):
    """Keeps the history (the input and the states) and recomputes the
    pre-activation in the backward."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        initial_state: Tensor | None,
        silu: bool,
        output_final_state: bool,
        layout: _HistoryLayout,
    ) -> tuple[Tensor, Tensor | None]:
        y, final_state, history = conv_forward(x, weight, initial_state, silu, output_final_state, layout)

        ctx.save_for_backward(history, weight)

        ctx.silu = silu
        ctx.layout = layout
        ctx.state_dtype = None if initial_state is None else initial_state.dtype

        return y, final_state

    @staticmethod
    def backward(
        ctx: Any, dy: Tensor, dht: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        history, weight = ctx.saved_tensors

        dx, dweight, dh0 = conv_backward(history, weight, dy, dht, ctx.silu, ctx.layout, ctx.state_dtype)

        return dx, dweight, dh0, None, None, None
