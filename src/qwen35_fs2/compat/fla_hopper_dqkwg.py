"""fla-core's gated ``chunk_bwd_dqkwg`` in PyTorch, for Hopper GPUs with
Triton 3.4.0 to 3.7.0.

fla-core 0.6.0 refuses the backward pass of its gated delta rule on Hopper
GPUs (H100, H200) with Triton 3.4.0 to 3.7.0, which compile one of its
kernels, ``chunk_bwd_dqkwg``, wrong there (fla issue #640), unless its
TileLang backend (the ``tilelang`` package and ``nvcc``) takes that kernel
over. fairseq2 0.8.1's torch 2.9.1 comes with Triton 3.5.1, so with the
pinned stack every H100 and H200 is affected (found on an H200 with Triton
3.6.0: each training step failed at its first backward pass).

fla lets another implementation take over one of its dispatched functions
(``fla.backends.register``). This module registers one for that function
alone, on exactly the machines where fla would refuse it and its own
TileLang fix is not usable: the other kernels of the layer, forward and
backward, stay fla's. The math is that of fla's Triton kernel
(``chunk_bwd_kernel_dqkwg`` in ``fla/ops/common/chunk_o.py``), one chunk of
``chunk_size`` tokens at a time, all chunks at once; the tests compare it
with that kernel under Triton's interpreter, fla's gated delta rule with it
against fla's own, and the fla layer with it against our PyTorch layer. It
has not run on a GPU yet.
"""

from __future__ import annotations

import importlib
import os
from functools import cache
from typing import Any

import torch
from torch import Tensor

from fairseq2.logging import log

from qwen35_fs2.ops.autocast import autocast_free


def fla_refuses_gated_backward() -> bool:
    """Returns ``True`` if fla's own check in ``chunk_bwd_dqkwg`` would
    refuse a gated call here: a Hopper GPU and Triton 3.4.0 to 3.7.0. The
    flags are read where fla's check reads them, so that the two agree."""
    chunk_o = importlib.import_module("fla.ops.common.chunk_o")

    return bool(chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1)


def fla_tilelang_takes_over() -> bool:
    """Returns ``True`` if fla's TileLang backend would run
    ``chunk_bwd_dqkwg`` (installed with ``nvcc``, and enabled)."""
    tilelang = importlib.import_module("fla.ops.common.backends.tilelang").CommonTileLangBackend

    return bool(tilelang.is_available() and tilelang().is_enabled())


def fla_needs_torch_dqkwg() -> bool:
    """Returns ``True`` where fla refuses its kernel and its TileLang fix is
    not usable: where :func:`chunk_bwd_dqkwg` runs in its place, once
    registered."""
    return fla_refuses_gated_backward() and not fla_tilelang_takes_over()


def fla_dispatch_disabled() -> bool:
    """Returns ``True`` if fla's backend dispatch is off
    (``FLA_DISABLE_BACKEND_DISPATCH=1``): then no registered implementation
    replaces fla's own functions."""
    return os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1"


@cache
def register_torch_chunk_bwd_dqkwg() -> None:
    """Registers :func:`chunk_bwd_dqkwg` with fla's dispatch of
    ``chunk_bwd_dqkwg``, for the machines of :func:`fla_needs_torch_dqkwg`.
    Once per process; imports fla."""
    backends = importlib.import_module("fla.backends")

    class TorchChunkBwdDqkwg(backends.BaseBackend):  # type: ignore[name-defined, misc]
        backend_type = "qwen35_torch"

        # Before fla's own backends: it is available only where they are not
        # (TileLang) or where fla would raise.
        priority = 0

        @classmethod
        def is_available(cls) -> bool:
            return fla_needs_torch_dqkwg()

        def chunk_bwd_dqkwg_verifier(self, *args: Any, **kwargs: Any) -> tuple[bool, str | None]:
            if kwargs.get("g") is None or kwargs.get("g_gamma") is not None:
                return False, "only the gated case (g given, no g_gamma) has a PyTorch version"

            if kwargs.get("scale") is None:
                return False, "`scale` must be given"

            if args:
                return False, "arguments must be passed by keyword, as fla's gated delta rule does"

            return True, None

        def chunk_bwd_dqkwg(self, **kwargs: Any) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
            _log_takeover()

            return chunk_bwd_dqkwg(**kwargs)

    backends.register("common")(TorchChunkBwdDqkwg)


@cache
def _log_takeover() -> None:
    log.info(
        "fla's chunk_bwd_dqkwg runs in PyTorch on this GPU: fla-core refuses its Triton kernel on Hopper GPUs with Triton < 3.7.1 (fla issue #640)."
    )


@autocast_free
def chunk_bwd_dqkwg(
    *,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    do: Tensor,
    h: Tensor,
    dh: Tensor,
    w: Tensor | None = None,
    g: Tensor | None = None,
    g_gamma: Tensor | None = None,
    dv: Tensor | None = None,
    scale: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    chunk_size: int = 64,
    chunk_indices: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """fla's ``chunk_bwd_dqkwg`` for the gated case, same arguments and
    results: the gradients of ``q``, ``k`` and ``w`` (``None`` without
    ``w``) and the per-token gradient of the chunk-local (log2) gate
    cumulative sums ``g``, before fla's reverse cumulative sum.

    Per chunk of ``BT = chunk_size`` tokens, with ``h``/``dh`` the state and
    its gradient at the chunk's start (``[K, V]``, or ``[V, K]`` with
    ``state_v_first``) and ``gl`` the last valid token's ``g``::

        dq = scale * (do @ h^T * 2^g + ds @ k)
        dk = v @ dh^T * 2^(gl - g) + ds^T @ q
        ds = scale * tril(do @ v^T * 2^(g_i - g_j))     (rounded to k's dtype)
        dw = -dv @ h^T
        dg = rowsum(dq * q) - rowsum(dk * k), and at the last valid token
             + 2^gl * sum(h * dh) + sum(v @ dh^T * 2^(gl - g) * k)

    computed in fp32, autocast or not (fla's backward pass runs under the
    forward's autocast state). ``q`` and ``k`` have ``H`` heads and the other
    tensors ``HV`` (a multiple of ``H``); ``dq`` and ``dk`` are summed over
    each group of value heads.
    """
    if g is None or g_gamma is not None or scale is None:
        raise ValueError("`g` and `scale` must be given and `g_gamma` must be `None` (the gated case only).")

    batch_size, seq_len, num_heads, _ = k.shape

    num_v_heads = v.shape[2]

    rows, valid = _chunk_rows(batch_size, seq_len, chunk_size, cu_seqlens, chunk_indices, q.device)

    num_rows = batch_size * seq_len

    def gather(x: Tensor) -> Tensor:
        """``[B, T, X, D]`` to ``[N, X, BT, D]`` in fp32, zero past the
        end of each sequence (as the kernel's masked loads)."""
        chunks = x.reshape(num_rows, *x.shape[2:])[rows.clamp(max=num_rows - 1)].float()

        chunks = chunks.masked_fill(~valid.view(*valid.shape, *([1] * (chunks.dim() - 2))), 0.0)

        return chunks.transpose(1, 2)

    group_size = num_v_heads // num_heads

    def by_group(x: Tensor) -> Tensor:
        """``[N, HV, ...]`` to ``[N, H, G, ...]``: the value heads of each
        query/key head, which ``q`` and ``k`` broadcast over."""
        return x.view(x.size(0), num_heads, group_size, *x.shape[2:])

    # [N, H, 1, BT, K]
    qc, kc = (gather(x).unsqueeze(2) for x in (q, k))

    # [N, H, G, BT, V]
    vc, doc = by_group(gather(v)), by_group(gather(do))

    gc = by_group(gather(g.unsqueeze(-1)).squeeze(-1))  # [N, H, G, BT]

    # The states at the chunks' starts: [N, H, G, V, K].
    hs, dhs = (by_group(x.reshape(-1, num_v_heads, *x.shape[-2:]).float()) for x in (h, dh))

    if not state_v_first:
        hs, dhs = hs.transpose(-1, -2), dhs.transpose(-1, -2)

    row_valid = valid[:, None, None, :]  # [N, 1, 1, BT]

    last = valid.sum(-1) - 1  # [N]

    g_last = gc.gather(-1, last.view(-1, 1, 1, 1).expand(-1, num_heads, group_size, 1))  # [N, H, G, 1]

    dg_last = (hs * dhs).sum((-2, -1)) * torch.exp2(g_last.squeeze(-1))

    dq = (doc @ hs) * torch.exp2(gc).unsqueeze(-1) * scale

    dk = (vc @ dhs) * torch.exp2(g_last - gc).masked_fill(~row_valid, 0.0).unsqueeze(-1)

    dg_last = dg_last + (dk * kc).sum((-2, -1))

    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()

    pairs = causal & row_valid.unsqueeze(-1) & row_valid.unsqueeze(-2)  # [N, 1, 1, BT, BT]

    ds = (doc @ vc.transpose(-1, -2)) * torch.exp2(gc.unsqueeze(-1) - gc.unsqueeze(-2))

    ds = (ds.masked_fill(~pairs, 0.0) * scale).to(k.dtype).float()

    dq = dq + ds @ kc

    dk = dk + ds.transpose(-1, -2) @ qc

    dg = (dq * qc).sum(-1) - (dk * kc).sum(-1)

    is_last = torch.arange(chunk_size, device=q.device) == last.unsqueeze(-1)  # [N, BT]

    dg = dg + is_last[:, None, None, :] * dg_last.unsqueeze(-1)

    def scatter(x: Tensor, like: Tensor) -> Tensor:
        """``[N, X, BT, D]`` back to ``[B, T, X, D]``; the rows past the
        end of each sequence go to a scratch row, then dropped."""
        out = x.new_zeros(num_rows + 1, *x.shape[1:2], *x.shape[3:])

        index = torch.where(valid, rows, num_rows).flatten()

        out.index_copy_(0, index, x.transpose(1, 2).flatten(0, 1))

        return out[:num_rows].view(*like.shape[:2], *out.shape[1:]).to(like.dtype)

    # The gradients of q and k sum over the value heads of each group.
    dq_full, dk_full = scatter(dq.sum(2), q), scatter(dk.sum(2), k)

    dw = None if w is None or dv is None else scatter(-(by_group(gather(dv)) @ hs).flatten(1, 2), w)

    dg_full = scatter(dg.flatten(1, 2).unsqueeze(-1), g.float()).squeeze(-1)

    return dq_full, dk_full, dw, dg_full


def _chunk_rows(
    batch_size: int,
    seq_len: int,
    chunk_size: int,
    cu_seqlens: Tensor | None,
    chunk_indices: Tensor | None,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """Returns, for every chunk in fla's order (the order of ``h``), the
    flat token rows it covers (``[N, BT]``) and which of them are before the
    end of its sequence. Computed on the device, without a host sync."""
    offsets = torch.arange(chunk_size, device=device)

    if cu_seqlens is None:
        num_chunks = -(-seq_len // chunk_size)

        seq_starts = torch.arange(batch_size, device=device).repeat_interleave(num_chunks) * seq_len

        chunk_starts = seq_starts + torch.arange(num_chunks, device=device).repeat(batch_size) * chunk_size

        seq_ends = seq_starts + seq_len
    else:
        if chunk_indices is None:
            chunk_indices = importlib.import_module("fla.ops.utils").prepare_chunk_indices(cu_seqlens, chunk_size)

        seq_idx, chunk_idx = chunk_indices[:, 0].long(), chunk_indices[:, 1].long()

        seq_starts = cu_seqlens.long()[seq_idx]

        chunk_starts = seq_starts + chunk_idx * chunk_size

        seq_ends = cu_seqlens.long()[seq_idx + 1]

    rows = chunk_starts.unsqueeze(-1) + offsets

    return rows, rows < seq_ends.unsqueeze(-1)
