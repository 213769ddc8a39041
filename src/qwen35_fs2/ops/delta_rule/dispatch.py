"""The gated delta rule entry point of the model: one signature, either
backend."""

from __future__ import annotations

import torch
from torch import Tensor

from qwen35_fs2.ops.backend import GdnBackend
from qwen35_fs2.ops.delta_rule.chunk import chunk_gated_delta_rule
from qwen35_fs2.ops.delta_rule.common import check_delta_rule_inputs, sequence_lengths
from qwen35_fs2.ops.delta_rule.recurrent import recurrent_gated_delta_rule
from qwen35_fs2.ops.fla_kernels import fla_gated_delta_rule
from qwen35_fs2.ops.varlen import VarlenMetadata


# The longest input that decodes from a state with the recurrent kernel.
_MAX_RECURRENT_DECODE_LEN = 8


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    backend: GdnBackend,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | VarlenMetadata | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Computes the gated delta rule with the kernels of ``backend``.

    ``torch`` runs :func:`chunk_gated_delta_rule`, or, to decode a few
    tokens from a state (a token, or one with its speculative drafts),
    :func:`recurrent_gated_delta_rule`, which does not pad them to a chunk
    and gives each token what decoding it alone would. ``fla`` runs fla-core's
    ``chunk_gated_delta_rule`` (``fused_recurrent_gated_delta_rule`` to decode
    one token without gradients). Both check the offsets against the
    sequence length on the host: pass :class:`VarlenMetadata` to avoid
    reading a ``cu_seqlens`` tensor back from the device.

    Pass the backend :func:`resolve_gdn_backend` returned at construction.
    The arguments are those of :func:`recurrent_gated_delta_rule`; ``q`` and
    ``k`` keep their ``H`` heads (value head ``j`` reads head ``j // (HV //
    H)``, never repeat them).
    """
    check_delta_rule_inputs(q, k, v, g, beta, initial_state, cu_seqlens)

    varlen = None if cu_seqlens is None else VarlenMetadata.of(cu_seqlens)

    # Under `torch.compile`, the kernels' operators check the lengths when
    # they run: reading them here would specialize the graph on them.
    if not torch.compiler.is_compiling():
        sequence_lengths(q.size(0), q.size(1), varlen)

    if backend == "fla":
        return fla_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            varlen=varlen,
            use_qk_l2norm=use_qk_l2norm,
        )

    if backend != "torch":
        raise ValueError(f"`backend` must be 'torch' or 'fla', but is '{backend}' instead.")

    if q.size(1) <= _MAX_RECURRENT_DECODE_LEN and initial_state is not None:
        kernel = recurrent_gated_delta_rule
    else:
        kernel = chunk_gated_delta_rule

    return kernel(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=varlen,
        use_qk_l2norm=use_qk_l2norm,
    )
