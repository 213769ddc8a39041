"""The gated RMSNorm of the Gated DeltaNet output (``linear_attn.norm``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from qwen35_fs2.ops.backend import GdnBackend
from qwen35_fs2.ops.fla_kernels import fla_gated_rms_norm


def gated_rms_norm(
    x: Tensor, gate: Tensor, weight: Tensor, eps: float, *, backend: GdnBackend = "torch"
) -> Tensor:
    """Computes ``weight * rms_norm(x) * silu(gate)`` over the last dimension.

    Unlike the ``(1 + weight)`` RMSNorm of the rest of Qwen3.5, the weight is
    used as is. As in the reference, the normalization and the gate are in
    fp32 (fp64 for fp64 inputs) while the weight multiplies the normalized
    ``x`` in ``x``'s dtype (fla keeps fp32 throughout: the results differ in
    the last bit in bf16).

    :param x: The input of shape ``[*, D]``.
    :param gate: The gate, of the shape of ``x``.
    :param weight: The weight of shape ``[D]``.
    """
    if gate.shape != x.shape:
        raise ValueError(
            f"`gate` must be of the shape of `x` {tuple(x.shape)}, but is of shape {tuple(gate.shape)} instead."
        )

    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"`weight` must be of shape ({x.size(-1)},), but is of shape {tuple(weight.shape)} instead."
        )

    if backend == "fla":
        return fla_gated_rms_norm(x, gate, weight, eps)

    dtype = torch.promote_types(x.dtype, torch.float32)

    h = x.to(dtype)

    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)

    h = weight * h.to(x.dtype)

    return (h * F.silu(gate.to(dtype))).to(x.dtype)
