"""The PyTorch kernels of the Gated DeltaNet layer on packed batches as
``torch.library`` custom operators, for ``torch.compile``.

Traced by dynamo, the chunked delta rule and the causal convolution of a
packed batch build their layouts from the documents' lengths on the host: the
graph specializes on every length, and each new packing recompiles (until
dynamo's recompile limit makes the layer run eagerly). As operators that take
the document offsets as a host tensor, they are opaque nodes of the graph
whose outputs' shapes depend only on the number of tokens ``T`` and of
documents ``N``: dynamo marks both dynamic at their first change, and a run
compiles a bounded number of graphs whatever its packings. The kernels inside
are those of eager mode (:func:`~qwen35_fs2.ops.delta_rule.chunk.chunk_forward`
and :func:`~qwen35_fs2.ops.causal_conv.conv_forward`, with their backward
passes), so compiled and eager training compute the same values.

Each operator builds its layout from the offsets when it runs (host integers
and a few index tensors, cheap against the kernels); the backward operators
build it again. A forward operator returns, besides its results, what its
backward needs: the delta rule's per-chunk tensors have ``NC`` rows, a count
that depends on the lengths, so they are padded to the bound
``T // C + N`` (every document adds at most one partial chunk), a shape the
fake implementation can state. The convolution keeps only its input.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from qwen35_fs2.ops.causal_conv import _HistoryLayout, conv_backward, conv_forward
from qwen35_fs2.ops.delta_rule.chunk import _ChunkLayout, chunk_backward, chunk_forward
from qwen35_fs2.ops.delta_rule.common import compute_dtype, document_lengths
from qwen35_fs2.ops.operator_outputs import empty_output, output_grad


def _num_seqs(cu_seqlens_cpu: Tensor) -> int:
    return cu_seqlens_cpu.size(0) - 1


def _chunk_capacity(seq_len: int, num_seqs: int, chunk_size: int) -> int:
    """An upper bound on the number of chunks of ``num_seqs`` documents of
    ``seq_len`` tokens in all."""
    return seq_len // chunk_size + num_seqs


def _fake_optional_grad(t: Tensor | None, placeholder_like: Tensor) -> Tensor:
    """The fake gradient of the optional input ``t``: like ``t``, or the
    placeholder of an absent output if ``t`` is ``None``."""
    if t is None:
        return empty_output(placeholder_like)

    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _pad_rows(x: Tensor, num_rows: int) -> Tensor:
    return torch.cat([x, x.new_zeros((num_rows - x.size(0),) + x.shape[1:])])


# The chunked gated delta rule.


@torch.library.custom_op("qwen35_fs2::packed_chunk_gated_delta_rule", mutates_args=())
def packed_chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens_cpu: Tensor,
    scale: float,
    use_qk_l2norm: bool,
    output_final_state: bool,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`~qwen35_fs2.ops.delta_rule.chunk.chunk_gated_delta_rule` on the
    documents at the offsets ``cu_seqlens_cpu`` (on the host) of the
    ``[1, T, ...]`` inputs.

    :returns: The output, the final states (empty unless
        ``output_final_state``), and, for the backward operator, the
        chunk-start states, ``(I + A)^-1`` and ``Vn``, each padded with zero
        chunks to ``T // C + N`` chunks.
    """
    lengths = document_lengths(cu_seqlens_cpu, q.size(1))

    layout = _ChunkLayout.packed(lengths, chunk_size, q.device)

    o, final_state, s, inv, vn = chunk_forward(
        q, k, v, g, beta, initial_state, scale, use_qk_l2norm, output_final_state, layout
    )

    capacity = _chunk_capacity(q.size(1), len(lengths), chunk_size)

    s, inv, vn = (_pad_rows(t, capacity) for t in (s, inv, vn))

    if final_state is None:
        final_state = empty_output(s)

    return o.contiguous(), final_state.contiguous(), s, inv, vn


@packed_chunk_gated_delta_rule.register_fake
def _(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens_cpu: Tensor,
    scale: float,
    use_qk_l2norm: bool,
    output_final_state: bool,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    seq_len, num_heads, key_dim = q.shape[1:]

    num_v_heads, value_dim = v.shape[2:]

    num_seqs = _num_seqs(cu_seqlens_cpu)

    dtype = compute_dtype(v)

    if output_final_state:
        final_state = q.new_empty((num_seqs, num_v_heads, key_dim, value_dim), dtype=dtype)
    else:
        final_state = q.new_empty((0,), dtype=dtype)

    chunks = (_chunk_capacity(seq_len, num_seqs, chunk_size), num_heads, num_v_heads // num_heads)

    s = q.new_empty(chunks + (key_dim, value_dim), dtype=dtype)
    inv = q.new_empty(chunks + (chunk_size, chunk_size), dtype=dtype)
    vn = q.new_empty(chunks + (chunk_size, value_dim), dtype=dtype)

    return torch.empty_like(v, memory_format=torch.contiguous_format), final_state, s, inv, vn


@torch.library.custom_op("qwen35_fs2::packed_chunk_gated_delta_rule_backward", mutates_args=())
def packed_chunk_gated_delta_rule_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    s: Tensor,
    inv: Tensor,
    vn: Tensor,
    do: Tensor,
    dht: Tensor | None,
    cu_seqlens_cpu: Tensor,
    scale: float,
    use_qk_l2norm: bool,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward pass of ``qwen35_fs2::packed_chunk_gated_delta_rule``.

    :returns: The gradients of ``q``, ``k``, ``v``, ``g``, ``beta`` and of
        the initial states (empty without them).
    """
    layout = _ChunkLayout.packed(document_lengths(cu_seqlens_cpu, q.size(1)), chunk_size, q.device)

    num_chunks = layout.num_chunks

    dq, dk, dv, dg, dbeta, dh0 = chunk_backward(
        q, k, v, g, beta, initial_state, s[:num_chunks], inv[:num_chunks], vn[:num_chunks], do, dht,
        scale, use_qk_l2norm, layout, initial_state is not None,
    )  # fmt: skip

    grads = (dq, dk, dv, dg, dbeta)

    return *(grad.contiguous() for grad in grads), empty_output(s) if dh0 is None else dh0.contiguous()


@packed_chunk_gated_delta_rule_backward.register_fake
def _(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    s: Tensor,
    inv: Tensor,
    vn: Tensor,
    do: Tensor,
    dht: Tensor | None,
    cu_seqlens_cpu: Tensor,
    scale: float,
    use_qk_l2norm: bool,
    chunk_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, g, beta))

    return *grads, _fake_optional_grad(initial_state, s)


def _setup_chunk_gated_delta_rule(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    q, k, v, g, beta, initial_state, cu_seqlens_cpu, scale, use_qk_l2norm, _, chunk_size = inputs

    _, _, s, inv, vn = output

    ctx.mark_non_differentiable(s, inv, vn)

    ctx.save_for_backward(q, k, v, g, beta, initial_state, s, inv, vn, cu_seqlens_cpu)

    ctx.scale = scale
    ctx.use_qk_l2norm = use_qk_l2norm
    ctx.chunk_size = chunk_size


def _chunk_gated_delta_rule_backward(ctx: Any, do: Tensor, dht: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
    q, k, v, g, beta, initial_state, s, inv, vn, cu_seqlens_cpu = ctx.saved_tensors

    dq, dk, dv, dg, dbeta, dh0 = torch.ops.qwen35_fs2.packed_chunk_gated_delta_rule_backward(
        q, k, v, g, beta, initial_state, s, inv, vn, do, output_grad(dht), cu_seqlens_cpu,
        ctx.scale, ctx.use_qk_l2norm, ctx.chunk_size,
    )  # fmt: skip

    return dq, dk, dv, dg, dbeta, None if initial_state is None else dh0, None, None, None, None, None


packed_chunk_gated_delta_rule.register_autograd(
    _chunk_gated_delta_rule_backward, setup_context=_setup_chunk_gated_delta_rule
)


# The causal convolution.


def _history_layout(cu_seqlens_cpu: Tensor, x: Tensor, width: int) -> _HistoryLayout:
    return _HistoryLayout.packed(document_lengths(cu_seqlens_cpu, x.size(1)), width, x.device)


@torch.library.custom_op("qwen35_fs2::packed_causal_conv1d", mutates_args=())
def packed_causal_conv1d(
    x: Tensor,
    weight: Tensor,
    initial_state: Tensor | None,
    cu_seqlens_cpu: Tensor,
    silu: bool,
    output_final_state: bool,
) -> tuple[Tensor, Tensor]:
    """:func:`~qwen35_fs2.ops.causal_conv.causal_conv1d`'s PyTorch path on the
    documents at the offsets ``cu_seqlens_cpu`` (on the host) of ``x`` ``[1,
    T, D]``.

    :returns: The output and the final states (empty unless
        ``output_final_state``).
    """
    layout = _history_layout(cu_seqlens_cpu, x, weight.size(1))

    y, final_state, _ = conv_forward(x, weight, initial_state, silu, output_final_state, layout)

    return y.contiguous(), empty_output(x) if final_state is None else final_state.contiguous()


@packed_causal_conv1d.register_fake
def _(
    x: Tensor,
    weight: Tensor,
    initial_state: Tensor | None,
    cu_seqlens_cpu: Tensor,
    silu: bool,
    output_final_state: bool,
) -> tuple[Tensor, Tensor]:
    if output_final_state:
        final_state = x.new_empty((_num_seqs(cu_seqlens_cpu), x.size(2), weight.size(1) - 1))
    else:
        final_state = empty_output(x)

    return torch.empty_like(x, memory_format=torch.contiguous_format), final_state


@torch.library.custom_op("qwen35_fs2::packed_causal_conv1d_backward", mutates_args=())
def packed_causal_conv1d_backward(
    x: Tensor,
    weight: Tensor,
    initial_state: Tensor | None,
    dy: Tensor,
    dht: Tensor | None,
    cu_seqlens_cpu: Tensor,
    silu: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward pass of ``qwen35_fs2::packed_causal_conv1d``; rebuilds
    the history from ``x`` and the initial states.

    :returns: The gradients of ``x``, ``weight`` and of the initial states
        (empty without them).
    """
    layout = _history_layout(cu_seqlens_cpu, x, weight.size(1))

    history = layout.build(x, initial_state)

    state_dtype = None if initial_state is None else initial_state.dtype

    dx, dweight, dh0 = conv_backward(history, weight, dy, dht, silu, layout, state_dtype)

    return dx.contiguous(), dweight.contiguous(), empty_output(x) if dh0 is None else dh0.contiguous()


@packed_causal_conv1d_backward.register_fake
def _(
    x: Tensor,
    weight: Tensor,
    initial_state: Tensor | None,
    dy: Tensor,
    dht: Tensor | None,
    cu_seqlens_cpu: Tensor,
    silu: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(weight, memory_format=torch.contiguous_format),
        _fake_optional_grad(initial_state, x),
    )


def _setup_causal_conv1d(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    x, weight, initial_state, cu_seqlens_cpu, silu, _ = inputs

    ctx.save_for_backward(x, weight, initial_state, cu_seqlens_cpu)

    ctx.silu = silu


def _causal_conv1d_backward(ctx: Any, dy: Tensor, dht: Tensor) -> tuple[Tensor | None, ...]:
    x, weight, initial_state, cu_seqlens_cpu = ctx.saved_tensors

    dx, dweight, dh0 = torch.ops.qwen35_fs2.packed_causal_conv1d_backward(
        x, weight, initial_state, dy, output_grad(dht), cu_seqlens_cpu, ctx.silu
    )

    return dx, dweight, None if initial_state is None else dh0, None, None, None


packed_causal_conv1d.register_autograd(_causal_conv1d_backward, setup_context=_setup_causal_conv1d)
