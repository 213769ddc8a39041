"""Thin wrappers over fla-core 0.6.0's Triton kernels (and Dao-AILab's
``causal_conv1d``), with the conventions of the PyTorch kernels.

fla is imported inside the functions: importing it is slow, and it must not
happen unless the ``fla`` backend was chosen.

fla derives index tensors from the document offsets of a packed batch (chunk
indices, sequence ids) and caches them by the identity of its arguments
(``fla.utils.tensor_cache``: the last few calls of each helper). The
wrappers pass it the offsets of :class:`VarlenMetadata`, device and host
copies, which the model makes once per batch and never modifies: every layer
of a forward pass, its backward pass and activation-checkpoint recomputation
then hit the same cache entries, and with the host copy fla sizes its chunk
layout without reading the device.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from qwen35_fs2.ops import fla_ops
from qwen35_fs2.ops.backend import has_causal_conv1d
from qwen35_fs2.ops.varlen import VarlenMetadata


def fla_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None,
    initial_state: Tensor | None,
    output_final_state: bool,
    varlen: VarlenMetadata | None,
    use_qk_l2norm: bool,
) -> tuple[Tensor, Tensor | None]:
    """Runs fla's chunked kernel, or its fused recurrent one to decode a single
    token without gradients (it has no backward).

    Under ``torch.compile``, runs the chunked kernel as the
    ``qwen35_fs2::fla_chunk_gated_delta_rule`` operator, which dynamo does
    not trace into."""
    if initial_state is not None:
        initial_state = initial_state.float()

    if torch.compiler.is_compiling():
        if scale is None:
            scale = q.size(-1) ** -0.5

        o, final_state, _, _ = fla_ops.fla_chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            initial_state,
            None if varlen is None else varlen.cu_seqlens,
            None if varlen is None else varlen.cu_seqlens_cpu,
            scale,
            output_final_state,
            use_qk_l2norm,
        )

        return o, final_state if output_final_state else None

    from fla.ops.gated_delta_rule import (  # type: ignore[import-untyped]
        chunk_gated_delta_rule,
        fused_recurrent_gated_delta_rule,
    )

    decoding = q.size(1) == 1 and not (
        torch.is_grad_enabled()
        and any(t.requires_grad for t in (q, k, v, g, beta, initial_state) if t is not None)
    )

    varlen_kwargs: dict[str, Tensor] = {}

    if varlen is not None:
        varlen_kwargs["cu_seqlens"] = varlen.cu_seqlens

        # The recurrent kernel takes no host copy.
        if not decoding:
            varlen_kwargs["cu_seqlens_cpu"] = varlen.cu_seqlens_cpu

    kernel = fused_recurrent_gated_delta_rule if decoding else chunk_gated_delta_rule

    # `beta` by keyword: the 5th positional parameter of the recurrent kernel
    # is `gk`.
    o, final_state = kernel(
        q,
        k,
        v,
        g=g,
        beta=beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        **varlen_kwargs,
    )

    # fla returns the output in the dtype of `q`.
    return o.to(v.dtype), final_state


def fla_causal_conv1d(
    x: Tensor,
    weight: Tensor,
    *,
    activation: Literal["silu"] | None,
    initial_state: Tensor | None,
    output_final_state: bool,
    varlen: VarlenMetadata | None,
) -> tuple[Tensor, Tensor | None]:
    """Runs Dao-AILab's ``causal_conv1d_fn`` when installed and no state is
    involved (training), fla's Triton kernel otherwise.

    Our states hold the last ``W - 1`` inputs ``[N, D, W - 1]``; fla's hold
    ``W`` of them ``[N, D, W]`` and never read the first.

    Under ``torch.compile``, fla's kernel runs as the
    ``qwen35_fs2::fla_causal_conv1d`` operator, which dynamo does not trace
    into; ``causal_conv1d_fn`` is traced as it is (recent causal-conv1d
    releases register their kernels as operators themselves; not tried
    without a GPU).
    """
    if initial_state is None and not output_final_state and has_causal_conv1d():
        return _dao_causal_conv1d(x, weight, activation, varlen), None

    if initial_state is not None:
        initial_state = F.pad(initial_state.to(x.dtype), (1, 0))

    cu_seqlens = None if varlen is None else varlen.cu_seqlens
    cu_seqlens_cpu = None if varlen is None else varlen.cu_seqlens_cpu

    final_state: Tensor | None

    if torch.compiler.is_compiling():
        y, final_state = fla_ops.fla_causal_conv1d(
            x, weight, initial_state, cu_seqlens, cu_seqlens_cpu, activation, output_final_state
        )

        if not output_final_state:
            final_state = None
    else:
        from fla.modules.causal_conv1d import causal_conv1d  # type: ignore[import-untyped]

        y, final_state = causal_conv1d(
            x,
            weight,
            initial_state=initial_state,
            output_final_state=output_final_state,
            activation=activation,
            backend="triton",
            cu_seqlens=cu_seqlens,
            cu_seqlens_cpu=cu_seqlens_cpu,
        )

    if final_state is not None:
        final_state = final_state[..., 1:].contiguous()

    return y, final_state


def _dao_causal_conv1d(
    x: Tensor, weight: Tensor, activation: Literal["silu"] | None, varlen: VarlenMetadata | None
) -> Tensor:
    from causal_conv1d import causal_conv1d_fn  # type: ignore[import-not-found]

    seq_idx: Tensor | None = None

    if varlen is not None:
        seq_idx = varlen.derived(("dao_seq_idx", x.device), lambda: _document_ids(varlen, x.device))

    # `seq_idx` needs channel-last inputs: (B, T, D) seen as (B, D, T).
    y: Tensor = causal_conv1d_fn(
        x.contiguous().transpose(1, 2),
        weight.to(x.dtype),
        bias=None,
        seq_idx=seq_idx,
        activation=activation,
    )

    return y.transpose(1, 2)


def fla_gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Runs fla's fused gated RMSNorm (``FusedRMSNormGated``'s function); as
    the ``qwen35_fs2::fla_gated_rms_norm`` operator under ``torch.compile``."""
    if torch.compiler.is_compiling():
        y, _ = fla_ops.fla_gated_rms_norm(x, gate, weight, eps)

        return y

    from fla.modules.fused_norm_gate import rms_norm_gated  # type: ignore[import-untyped]

    y: Tensor = rms_norm_gated(x, gate, weight, None, activation="silu", eps=eps)

    return y


def _document_ids(varlen: VarlenMetadata, device: torch.device) -> Tensor:
    """``(1, T)``: the document of every token, as int32."""
    lengths = torch.tensor(varlen.lengths, dtype=torch.int64)

    seq_idx = torch.repeat_interleave(torch.arange(varlen.num_seqs), lengths)

    return seq_idx.to(device=device, dtype=torch.int32).unsqueeze(0)
