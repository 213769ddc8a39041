"""Shape checks and small helpers shared by the delta-rule implementations."""

from __future__ import annotations

import torch
from torch import Tensor

from qwen35_fs2.ops.varlen import VarlenMetadata


def l2_normalize(x: Tensor) -> Tensor:
    """Divides by ``sqrt(sum(x^2) + 1e-6)`` over the last dimension.

    Not ``x / max(norm, eps)`` like ``F.normalize``: this is what fla's kernel
    and the transformers reference compute.
    """
    return x * l2_inverse_norm(x)


def l2_inverse_norm(x: Tensor) -> Tensor:
    """Returns ``1 / sqrt(sum(x^2) + 1e-6)`` over the last dimension (kept)."""
    return torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + 1e-6)


def expand_qk_heads(x: Tensor, num_v_heads: int) -> Tensor:
    """Repeats query/key heads ``[..., H, K]`` to ``[..., HV, K]``.

    Value head ``j`` reads query/key head ``j // (HV // H)``.
    """
    num_heads = x.size(-2)

    if num_heads == num_v_heads:
        return x

    return x.repeat_interleave(num_v_heads // num_heads, dim=-2)


def compute_dtype(x: Tensor) -> torch.dtype:
    """Returns the dtype the recurrence runs in: fp32, or fp64 for fp64 inputs
    (which gradient checks need)."""
    return torch.promote_types(x.dtype, torch.float32)


def sequence_lengths(
    batch_size: int, seq_len: int, varlen: VarlenMetadata | None
) -> list[int]:
    """Returns the length of every sequence of the batch, from host data
    only."""
    if varlen is None:
        return [seq_len] * batch_size

    if varlen.num_tokens != seq_len:
        raise ValueError(
            f"`cu_seqlens` must start at 0 and end at the sequence length T={seq_len}, but ends at {varlen.num_tokens} instead."
        )

    return list(varlen.lengths)


def document_lengths(cu_seqlens_cpu: Tensor, seq_len: int) -> list[int]:
    """Returns the lengths of the documents at the offsets ``cu_seqlens_cpu``
    (a host tensor), checked to cover the ``seq_len`` tokens of a packed
    batch: what the custom operators check when they run under
    ``torch.compile``, where their callers do not read the lengths."""
    varlen = VarlenMetadata(cu_seqlens_cpu.tolist(), cu_seqlens_cpu.device)

    return sequence_lengths(1, seq_len, varlen)


def check_delta_rule_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | VarlenMetadata | None,
) -> None:
    """Raises a :class:`ValueError` naming the first inconsistent shape."""
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(
            f"`q` and `k` must both be of shape [B, T, H, K], but are {tuple(q.shape)} and {tuple(k.shape)} instead."
        )

    batch_size, seq_len, num_heads, key_dim = q.shape

    if v.ndim != 4 or v.shape[:2] != (batch_size, seq_len):
        raise ValueError(
            f"`v` must be of shape [B={batch_size}, T={seq_len}, HV, V], but is {tuple(v.shape)} instead."
        )

    num_v_heads, value_dim = v.shape[2], v.shape[3]

    if num_v_heads % num_heads != 0:
        raise ValueError(
            f"The number of value heads (HV={num_v_heads}) must be a multiple of the number of query/key heads (H={num_heads}), but HV % H = {num_v_heads % num_heads}."
        )

    gate_shape = (batch_size, seq_len, num_v_heads)

    if g.shape != gate_shape or beta.shape != gate_shape:
        raise ValueError(
            f"`g` and `beta` must both be of shape [B, T, HV] = {gate_shape}, but are {tuple(g.shape)} and {tuple(beta.shape)} instead."
        )

    if cu_seqlens is not None:
        if batch_size != 1:
            raise ValueError(
                f"The batch size must be 1 when `cu_seqlens` is given, but is {batch_size} instead."
            )

        if isinstance(cu_seqlens, VarlenMetadata):
            num_seqs = cu_seqlens.num_seqs
        else:
            if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
                raise ValueError(
                    f"`cu_seqlens` must be a 1-D tensor of at least 2 offsets, but has shape {tuple(cu_seqlens.shape)} instead."
                )

            if cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
                raise ValueError(
                    f"`cu_seqlens` must be an integer tensor, but is of type {cu_seqlens.dtype} instead."
                )

            num_seqs = cu_seqlens.numel() - 1
    else:
        num_seqs = batch_size

    if initial_state is not None:
        state_shape = (num_seqs, num_v_heads, key_dim, value_dim)

        if initial_state.shape != state_shape:
            raise ValueError(
                f"`initial_state` must be of shape [N, HV, K, V] = {state_shape}, but is {tuple(initial_state.shape)} instead."
            )
