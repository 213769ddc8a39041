"""fla-core 0.6.0's training kernels as ``torch.library`` custom operators,
for ``torch.compile``.

Dynamo cannot trace fla's entry points: ``chunk_gated_delta_rule`` is marked
``torch.compiler.disable`` (a graph break), and the convolution and the
gated norm launch Triton kernels through autotuners from inside autograd
functions. As custom operators, each with a fake implementation (the shapes
of its outputs) and a registered backward operator, they are opaque nodes of
the graph, forward and backward, and a whole Gated DeltaNet layer on the
``fla`` backend compiles with ``fullgraph=True``.

Each forward operator runs what fla's autograd function runs in its
``forward`` and returns, besides the result, what its ``backward`` keeps
(fla's autograd functions cannot be split across two operators); each
backward operator runs what that ``backward`` runs. The wrappers of
:mod:`qwen35_fs2.ops.fla_kernels` call them only under ``torch.compile``;
eager code calls fla's own functions.

fla is imported inside the implementations: registering the operators must
not import it. Outputs that a call does not produce (no final state, no
initial state to differentiate) are empty tensors: an operator returns
tensors only.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Final

import torch
from torch import Tensor

from qwen35_fs2.ops.delta_rule.common import document_lengths
from qwen35_fs2.ops.operator_outputs import empty_output, output_grad

_CHUNK_SIZE: Final = 64
"""fla's default chunk size for the gated delta rule."""


def _on_device_of(x: Tensor) -> AbstractContextManager[Any]:
    """fla's kernels launch on the current device: its autograd functions
    make it that of their inputs (``input_guard``), and so do the
    operators."""
    from fla.utils import custom_device_ctx  # type: ignore[import-untyped]

    ctx: AbstractContextManager[Any] = custom_device_ctx(x.device.index)

    return ctx


def _contiguous(*tensors: Tensor | None) -> tuple[Any, ...]:
    """fla's kernels index their arguments as contiguous: its autograd
    functions make them so (``input_guard``), gradients included (autograd
    may hand in expanded ones), and so do the operators."""
    return tuple(None if t is None else t.contiguous() for t in tensors)


def _num_seqs(batch_size: int, cu_seqlens: Tensor | None) -> int:
    return batch_size if cu_seqlens is None else cu_seqlens.size(0) - 1


def _chunk_indices(cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None) -> Tensor | None:
    """fla's chunk layout of a packed batch (cached by fla for these offsets)."""
    if cu_seqlens is None:
        return None

    from fla.ops.utils.index import prepare_chunk_indices  # type: ignore[import-untyped]

    indices: Tensor = prepare_chunk_indices(cu_seqlens, _CHUNK_SIZE, cu_seqlens_cpu=cu_seqlens_cpu)

    return indices


# The gated delta rule.


@torch.library.custom_op("qwen35_fs2::fla_chunk_gated_delta_rule", mutates_args=())
def fla_chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    scale: float,
    output_final_state: bool,
    use_qk_l2norm: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fla's ``chunk_gated_delta_rule``.

    :returns: The output ``[B, T, HV, V]`` in the dtype of ``v``; the final
        states ``[N, HV, K, V]`` in fp32 (empty unless
        ``output_final_state``); and, for the backward operator, the
        chunk-local cumulative log decays ``[B, T, HV]`` (fp32) and fla's
        ``A``, the inverted intra-chunk systems ``[B, T, HV, 64]``.
    """
    from fla.modules.norm.l2norm import l2norm_fwd  # type: ignore[import-untyped]
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd  # type: ignore[import-untyped]

    # Its callers do not check the offsets under `torch.compile`.
    if cu_seqlens_cpu is not None:
        document_lengths(cu_seqlens_cpu, q.size(1))

    q, k, v, g, beta, initial_state = _contiguous(q, k, v, g, beta, initial_state)

    with _on_device_of(q):
        if use_qk_l2norm:
            q, _ = l2norm_fwd(q)
            k, _ = l2norm_fwd(k)

        g_cumsum, o, a, final_state, _, _ = chunk_gated_delta_rule_fwd(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=cu_seqlens,
            chunk_indices=_chunk_indices(cu_seqlens, cu_seqlens_cpu),
            chunk_size=_CHUNK_SIZE,
        )

    if final_state is None:
        final_state = empty_output(g_cumsum)

    return o.to(v.dtype), final_state, g_cumsum, a


@fla_chunk_gated_delta_rule.register_fake
def _(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    scale: float,
    output_final_state: bool,
    use_qk_l2norm: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    batch_size, seq_len, _, key_dim = q.shape

    num_v_heads, value_dim = v.shape[2:]

    if output_final_state:
        shape = (_num_seqs(batch_size, cu_seqlens), num_v_heads, key_dim, value_dim)

        final_state = q.new_empty(shape, dtype=torch.float32)
    else:
        final_state = q.new_empty((0,), dtype=torch.float32)

    g_cumsum = torch.empty_like(g, dtype=torch.float32, memory_format=torch.contiguous_format)

    a = q.new_empty((batch_size, seq_len, num_v_heads, _CHUNK_SIZE))

    return torch.empty_like(v, memory_format=torch.contiguous_format), final_state, g_cumsum, a


@torch.library.custom_op("qwen35_fs2::fla_chunk_gated_delta_rule_backward", mutates_args=())
def fla_chunk_gated_delta_rule_backward(
    do: Tensor,
    dht: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_cumsum: Tensor,
    beta: Tensor,
    a: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward pass of ``qwen35_fs2::fla_chunk_gated_delta_rule``.

    The normalized ``q`` and ``k`` are recomputed (one elementwise pass each)
    rather than kept.

    :returns: The gradients of ``q``, ``k``, ``v``, ``g``, ``beta`` (in their
        dtypes; ``g``'s in fp32, that of the cumulative decays, as fla's) and
        of the initial states (empty without them).
    """
    from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd  # type: ignore[import-untyped]
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd  # type: ignore[import-untyped]

    inputs = (q, k, v, g_cumsum, beta)

    do, dht, qn, kn, v, g_cumsum, beta, a, initial_state = _contiguous(
        do, dht, *inputs, a, initial_state
    )

    with _on_device_of(q):
        if use_qk_l2norm:
            qn, q_rstd = l2norm_fwd(qn)
            kn, k_rstd = l2norm_fwd(kn)

        dq, dk, dv, dbeta, dg, dh0, _, _ = chunk_gated_delta_rule_bwd(
            q=qn,
            k=kn,
            v=v,
            g=g_cumsum,
            beta=beta,
            A=a,
            scale=scale,
            initial_state=initial_state,
            do=do,
            dht=dht,
            cu_seqlens=cu_seqlens,
            chunk_indices=_chunk_indices(cu_seqlens, cu_seqlens_cpu),
            chunk_size=_CHUNK_SIZE,
        )

        if use_qk_l2norm:
            dq = l2norm_bwd(qn, q_rstd, dq)
            dk = l2norm_bwd(kn, k_rstd, dk)

    if dh0 is None:
        dh0 = empty_output(g_cumsum)

    grads = (dq, dk, dv, dg, dbeta)

    return *(grad.to(t.dtype) for grad, t in zip(grads, inputs)), dh0


@fla_chunk_gated_delta_rule_backward.register_fake
def _(
    do: Tensor,
    dht: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_cumsum: Tensor,
    beta: Tensor,
    a: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, g_cumsum, beta))

    dh0 = g_cumsum.new_empty((0,)) if initial_state is None else torch.empty_like(initial_state)

    return *grads, dh0


def _setup_chunk_gated_delta_rule(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    q, k, v, _, beta, initial_state, cu_seqlens, cu_seqlens_cpu, scale, _, use_qk_l2norm = inputs

    _, _, g_cumsum, a = output

    ctx.mark_non_differentiable(g_cumsum, a)

    ctx.save_for_backward(q, k, v, g_cumsum, beta, a, initial_state, cu_seqlens, cu_seqlens_cpu)

    ctx.scale = scale
    ctx.use_qk_l2norm = use_qk_l2norm


def _chunk_gated_delta_rule_backward(ctx: Any, do: Tensor, dht: Tensor, *_: Tensor) -> tuple[Tensor | None, ...]:
    q, k, v, g_cumsum, beta, a, initial_state, cu_seqlens, cu_seqlens_cpu = ctx.saved_tensors

    dq, dk, dv, dg, dbeta, dh0 = torch.ops.qwen35_fs2.fla_chunk_gated_delta_rule_backward(
        do,
        output_grad(dht),
        q,
        k,
        v,
        g_cumsum,
        beta,
        a,
        initial_state,
        cu_seqlens,
        cu_seqlens_cpu,
        ctx.scale,
        ctx.use_qk_l2norm,
    )

    return dq, dk, dv, dg, dbeta, None if initial_state is None else dh0, None, None, None, None, None


fla_chunk_gated_delta_rule.register_autograd(
    _chunk_gated_delta_rule_backward, setup_context=_setup_chunk_gated_delta_rule
)


# The causal convolution.


@torch.library.custom_op("qwen35_fs2::fla_causal_conv1d", mutates_args=())
def fla_causal_conv1d(
    x: Tensor,
    weight: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    activation: str | None,
    output_final_state: bool,
) -> tuple[Tensor, Tensor]:
    """fla's Triton ``causal_conv1d``, states in fla's layout ``[N, D, W]``.

    :returns: The output ``[B, T, D]`` and the final states (empty unless
        ``output_final_state``).
    """
    from fla.modules.causal_conv1d import causal_conv1d_fwd  # type: ignore[import-untyped]

    # Its callers do not check the offsets under `torch.compile`.
    if cu_seqlens_cpu is not None:
        document_lengths(cu_seqlens_cpu, x.size(1))

    x, weight, initial_state = _contiguous(x, weight, initial_state)

    with _on_device_of(x):
        y, final_state = causal_conv1d_fwd(
            x=x,
            weight=weight,
            bias=None,
            residual=None,
            initial_state=initial_state,
            output_final_state=output_final_state,
            activation=activation,
            cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu,
        )

    return y, empty_output(x) if final_state is None else final_state


@fla_causal_conv1d.register_fake
def _(
    x: Tensor,
    weight: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    activation: str | None,
    output_final_state: bool,
) -> tuple[Tensor, Tensor]:
    if output_final_state:
        final_state = x.new_empty((_num_seqs(x.size(0), cu_seqlens), x.size(2), weight.size(1)))
    else:
        final_state = x.new_empty((0,))

    return torch.empty_like(x, memory_format=torch.contiguous_format), final_state


@torch.library.custom_op("qwen35_fs2::fla_causal_conv1d_backward", mutates_args=())
def fla_causal_conv1d_backward(
    dy: Tensor,
    dht: Tensor | None,
    x: Tensor,
    weight: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    activation: str | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward pass of ``qwen35_fs2::fla_causal_conv1d``.

    :returns: The gradients of ``x``, ``weight`` and the initial states
        (empty without them).
    """
    from fla.modules.causal_conv1d import causal_conv1d_bwd  # type: ignore[import-untyped]

    dy, dht, x, weight, initial_state = _contiguous(dy, dht, x, weight, initial_state)

    with _on_device_of(x):
        dx, dweight, _, _, dh0 = causal_conv1d_bwd(
            x=x,
            dy=dy,
            dht=dht,
            weight=weight,
            bias=None,
            residual=None,
            initial_state=initial_state,
            activation=activation,
            cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu,
        )

    return dx, dweight, empty_output(x) if dh0 is None else dh0


@fla_causal_conv1d_backward.register_fake
def _(
    dy: Tensor,
    dht: Tensor | None,
    x: Tensor,
    weight: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    cu_seqlens_cpu: Tensor | None,
    activation: str | None,
) -> tuple[Tensor, Tensor, Tensor]:
    dh0 = x.new_empty((0,)) if initial_state is None else torch.empty_like(initial_state)

    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight), dh0


def _setup_causal_conv1d(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    x, weight, initial_state, cu_seqlens, cu_seqlens_cpu, activation, _ = inputs

    ctx.save_for_backward(x, weight, initial_state, cu_seqlens, cu_seqlens_cpu)

    ctx.activation = activation


def _causal_conv1d_backward(ctx: Any, dy: Tensor, dht: Tensor) -> tuple[Tensor | None, ...]:
    x, weight, initial_state, cu_seqlens, cu_seqlens_cpu = ctx.saved_tensors

    dx, dweight, dh0 = torch.ops.qwen35_fs2.fla_causal_conv1d_backward(
        dy,
        output_grad(dht),
        x,
        weight,
        initial_state,
        cu_seqlens,
        cu_seqlens_cpu,
        ctx.activation,
    )

    return dx, dweight, None if initial_state is None else dh0, None, None, None, None


fla_causal_conv1d.register_autograd(_causal_conv1d_backward, setup_context=_setup_causal_conv1d)


# The gated RMSNorm.


@torch.library.custom_op("qwen35_fs2::fla_gated_rms_norm", mutates_args=())
def fla_gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """fla's fused ``weight * rms_norm(x) * silu(gate)`` over the last
    dimension.

    :returns: The output, of the shape of ``x``, and the inverse RMS of every
        row (fp32), for the backward operator.
    """
    from fla.modules.fused_norm_gate import layer_norm_gated_fwd  # type: ignore[import-untyped]

    with _on_device_of(x):
        y, _, rstd, _ = layer_norm_gated_fwd(
            x=x.reshape(-1, x.size(-1)).contiguous(),
            g=gate.reshape(-1, gate.size(-1)).contiguous(),
            weight=weight.contiguous(),
            bias=None,
            activation="silu",
            eps=eps,
            is_rms_norm=True,
        )

    return y.view(x.shape), rstd


@fla_gated_rms_norm.register_fake
def _(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    num_rows = x.numel() // x.size(-1)

    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((num_rows,), dtype=torch.float32)


@torch.library.custom_op("qwen35_fs2::fla_gated_rms_norm_backward", mutates_args=())
def fla_gated_rms_norm_backward(
    dy: Tensor, x: Tensor, gate: Tensor, weight: Tensor, rstd: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward pass of ``qwen35_fs2::fla_gated_rms_norm``: the gradients
    of ``x``, ``gate`` and ``weight``."""
    from fla.modules.fused_norm_gate import layer_norm_gated_bwd  # type: ignore[import-untyped]

    def rows(t: Tensor) -> Tensor:
        return t.reshape(-1, t.size(-1)).contiguous()

    with _on_device_of(x):
        dx, dgate, dweight, _, _ = layer_norm_gated_bwd(
            dy=rows(dy),
            x=rows(x),
            g=rows(gate),
            weight=weight.contiguous(),
            bias=None,
            activation="silu",
            eps=eps,
            rstd=rstd.contiguous(),
            is_rms_norm=True,
            x_dtype=x.dtype,
        )

    return dx.view(x.shape), dgate.view(gate.shape), dweight


@fla_gated_rms_norm_backward.register_fake
def _(
    dy: Tensor, x: Tensor, gate: Tensor, weight: Tensor, rstd: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        # fla gives the gate the gradient dtype of `x`.
        torch.empty_like(gate, dtype=x.dtype, memory_format=torch.contiguous_format),
        torch.empty_like(weight),
    )


def _setup_gated_rms_norm(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    x, gate, weight, eps = inputs

    _, rstd = output

    ctx.mark_non_differentiable(rstd)

    ctx.save_for_backward(x, gate, weight, rstd)

    ctx.eps = eps


def _gated_rms_norm_backward(ctx: Any, dy: Tensor, _: Tensor) -> tuple[Tensor | None, ...]:
    grads = torch.ops.qwen35_fs2.fla_gated_rms_norm_backward(dy, *ctx.saved_tensors, ctx.eps)

    return *grads, None


fla_gated_rms_norm.register_autograd(_gated_rms_norm_backward, setup_context=_setup_gated_rms_norm)
