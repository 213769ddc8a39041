"""The chunked gated delta rule in plain PyTorch, with a hand-written backward.

Shape letters: ``B`` batch, ``T`` tokens, ``H`` query/key heads, ``HV`` value
heads, ``G = HV // H`` value heads per query/key head, ``K`` key dim, ``V``
value dim, ``N`` sequences, ``NC`` chunks (of all sequences), ``C`` chunk
size.

Within a chunk, with ``gamma`` the cumulative log decay since the chunk start,
``D[i, j] = exp(gamma_i - gamma_j)`` for ``i >= j`` (``0`` above) and ``S``
the state at the chunk start, the ``C`` delta-rule updates collapse into
(the WY representation, solved as a unit lower-triangular system)::

    A     = tril(diag(beta) (K K^T * D), -1)
    [U|W] = (I + A)^-1 [diag(beta) V | diag(beta exp(gamma)) K]
    Vn    = U - W S                       # what the chunk writes
    O     = diag(exp(gamma)) Q S + (tril(Q K^T * D)) Vn
    S'    = exp(gamma_C) S + (diag(exp(gamma_C - gamma)) K)^T Vn

Everything but the ``S -> S'`` recurrence runs for all chunks at once. Every
exponent is a difference ``gamma_i - gamma_j`` with ``i >= j`` (masked before
``exp``), so strong decay underflows to 0 and never overflows.

The backward recomputes the intra-chunk terms from the inputs and the
chunk-start states, which is all it keeps from the forward: activations stay
at the size of the inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final, final

import torch
import torch.nn.functional as F
from torch import Tensor

from qwen35_fs2.ops.delta_rule.common import (
    check_delta_rule_inputs,
    compute_dtype,
    sequence_lengths,
)


_MIN_FP32_EXPONENT: Final = -30.0


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """Computes the gated delta rule chunk by chunk (the training path).

    Same contract as :func:`recurrent_gated_delta_rule`. Documents of a packed
    batch are cut into chunks of their own (a chunk never straddles two
    documents), so nothing leaks between documents.

    Under ``torch.compile``, ``cu_seqlens`` is read on the host (a graph
    break) and the graph specializes on the number of chunks per document;
    without ``cu_seqlens`` only shapes are used.

    :param chunk_size: The number of tokens solved together; 64 is fastest
        on CPU and matches fla.

    :returns: The output of shape ``[B, T, HV, V]`` in the dtype of ``v``, and
        the final states of shape ``[N, HV, K, V]`` in fp32 (or ``None``).
    """
    check_delta_rule_inputs(q, k, v, g, beta, initial_state, cu_seqlens)

    if chunk_size < 1:
        raise ValueError(
            f"`chunk_size` must be greater than or equal to 1, but is {chunk_size} instead."
        )

    batch_size, seq_len, _, key_dim = q.shape

    if scale is None:
        scale = key_dim**-0.5

    if seq_len == 0:
        num_seqs = batch_size if cu_seqlens is None else cu_seqlens.numel() - 1

        state_shape = (num_seqs, v.size(2), key_dim, v.size(3))

        return _empty_outputs(v, initial_state, output_final_state, state_shape)

    if cu_seqlens is None:
        layout = _ChunkLayout.regular(batch_size, seq_len, chunk_size)
    else:
        layout = _ChunkLayout.packed(
            sequence_lengths(batch_size, seq_len, cu_seqlens), chunk_size, q.device
        )

    o, final_state = _ChunkGatedDeltaRuleFunction.apply(
        q,
        k,
        v,
        g,
        beta,
        initial_state,
        scale,
        use_qk_l2norm,
        output_final_state,
        layout,
    )

    return o, final_state


def _empty_outputs(
    v: Tensor,
    initial_state: Tensor | None,
    output_final_state: bool,
    state_shape: tuple[int, ...],
) -> tuple[Tensor, Tensor | None]:
    """The outputs for ``T = 0``: nothing, and the states unchanged (both
    still in the autograd graph)."""
    o = v.clone()

    if not output_final_state:
        return o, None

    if initial_state is None:
        return o, v.new_zeros(state_shape, dtype=compute_dtype(v))

    return o, initial_state.to(compute_dtype(v))


@final
@dataclass(frozen=True)
class _ChunkLayout:
    """Where every token sits once its sequence is cut into chunks.

    Chunks are ordered by their index within their sequence, then by
    sequence, the sequences sorted by decreasing chunk count: the chunks of
    the ``j``-th recurrence step are then contiguous, and so are the states
    of the sequences still running (a prefix of the state rows).
    """

    chunk_size: int

    num_seqs: int

    seq_len: int
    """``T``, the length of the rows of the batch."""

    step_sizes: tuple[int, ...]
    """The number of sequences with a ``j``-th chunk, non-increasing."""

    token_slots: Tensor | None
    """``[num_tokens]``: the chunk slot (``chunk * C + offset``) of every
    token of a packed batch; ``None`` for a regular batch, whose rows are
    simply cut (a reshape, much faster than a gather on CPU)."""

    seq_order: Tensor | None
    """``[N]``: the sequence of each state row; ``None`` if in order."""

    seq_ranks: Tensor | None
    """``[N]``: the state row of each sequence (the inverse of ``seq_order``)."""

    @staticmethod
    def regular(batch_size: int, seq_len: int, chunk_size: int) -> _ChunkLayout:
        num_chunks = -(-seq_len // chunk_size)

        return _ChunkLayout(
            chunk_size, batch_size, seq_len, (batch_size,) * num_chunks, None, None, None
        )

    @staticmethod
    def packed(lengths: list[int], chunk_size: int, device: torch.device) -> _ChunkLayout:
        num_seqs = len(lengths)

        num_chunks = [-(-length // chunk_size) for length in lengths]

        # A stable sort: sequences of equal chunk counts keep their order.
        order = sorted(range(num_seqs), key=lambda seq_idx: -num_chunks[seq_idx])

        ranks = [0] * num_seqs

        for rank, seq_idx in enumerate(order):
            ranks[seq_idx] = rank

        step_sizes = tuple(
            sum(1 for count in num_chunks if count > step)
            for step in range(max(num_chunks, default=0))
        )

        step_offsets, seq_begins = [0], [0]

        for step_size in step_sizes:
            step_offsets.append(step_offsets[-1] + step_size)

        for length in lengths:
            seq_begins.append(seq_begins[-1] + length)

        num_tokens = seq_begins[-1]

        def as_tensor(values: list[int]) -> Tensor:
            return torch.tensor(values, device=device, dtype=torch.int64)

        # Token `t` at position `p` of the sequence of rank `r` sits at
        # offset `p % C` of chunk `step_offsets[p // C] + r`.
        token_seqs = torch.repeat_interleave(
            torch.arange(num_seqs, device=device), as_tensor(lengths), output_size=num_tokens
        )

        positions = torch.arange(num_tokens, device=device) - as_tensor(seq_begins[:-1])[token_seqs]

        token_chunks = as_tensor(step_offsets)[positions // chunk_size] + as_tensor(ranks)[token_seqs]

        token_slots = token_chunks * chunk_size + positions % chunk_size

        if order == list(range(num_seqs)):
            seq_order, seq_ranks = None, None
        else:
            seq_order, seq_ranks = as_tensor(order), as_tensor(ranks)

        return _ChunkLayout(
            chunk_size, num_seqs, num_tokens, step_sizes, token_slots, seq_order, seq_ranks
        )

    @property
    def num_chunks(self) -> int:
        return sum(self.step_sizes)

    @property
    def first_step_size(self) -> int:
        """The number of sequences with at least one chunk."""
        return self.step_sizes[0] if self.step_sizes else 0

    def step_bounds(self) -> list[tuple[int, int, int]]:
        """``(begin, end, next_size)`` of the chunks of every recurrence step."""
        bounds = []

        begin = 0

        for step, step_size in enumerate(self.step_sizes):
            next_size = self.step_sizes[step + 1] if step + 1 < len(self.step_sizes) else 0

            bounds.append((begin, begin + step_size, next_size))

            begin += step_size

        return bounds

    def split_heads(self, x: Tensor, num_heads: int) -> Tensor:
        """``[B, T, HV, *F]`` -> ``[NC, H, G, C, *F]`` (``G = 1`` if ``x`` has
        ``H`` heads), with zeros past the end of every sequence; always a new
        tensor."""
        num_v_heads, features = x.size(2), x.shape[3:]

        chunk_shape = (self.num_chunks, num_v_heads, self.chunk_size) + features

        if self.token_slots is None:
            pad = len(self.step_sizes) * self.chunk_size - self.seq_len

            if pad > 0:
                x = torch.cat([x, x.new_zeros((x.size(0), pad) + x.shape[2:])], dim=1)

            # (B, NC / B, C, HV, *F) -> (NC / B, B, HV, C, *F)
            x = x.unflatten(1, (-1, self.chunk_size)).movedim(0, 1).movedim(2, 3)

            # Always a copy, which callers may modify in place.
            chunks = torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)

            chunks = chunks.view(chunk_shape)
        else:
            chunks = x.new_zeros((self.num_chunks * self.chunk_size, num_v_heads) + features)

            chunks.index_copy_(0, self.token_slots, x.flatten(0, 1))

            chunks = chunks.unflatten(0, (-1, self.chunk_size)).movedim(1, 2).contiguous()

        return chunks.unflatten(1, (num_heads, -1))

    def merge_heads(self, x: Tensor, batch_size: int) -> Tensor:
        """The inverse of :meth:`split_heads`."""
        # (NC, H, G, C, *F) -> (NC, C, HV, *F)
        x = x.flatten(1, 2).movedim(2, 1)

        if self.token_slots is not None:
            return x.flatten(0, 1)[self.token_slots].unflatten(0, (batch_size, -1))

        # (NC / B, B, C, HV, *F) -> (B, T, HV, *F)
        x = x.unflatten(0, (-1, batch_size)).movedim(1, 0).flatten(1, 2)

        return x[:, : self.seq_len]

    def to_rows(self, x: Tensor) -> Tensor:
        """Orders the per-sequence ``x`` as the state rows."""
        return x if self.seq_order is None else x[self.seq_order]

    def to_seqs(self, x: Tensor) -> Tensor:
        """Orders the per-row ``x`` as the sequences."""
        return x if self.seq_ranks is None else x[self.seq_ranks]


def _invert_unit_lower(a: Tensor, block_size: int = 16) -> Tensor:
    """Returns ``(I + tril(a, -1))^-1`` for ``a`` of shape ``[..., C, C]``.

    The diagonal blocks are inverted by triangular solves, the blocks below
    by block forward substitution: on CPU, batched solves of 64 x 64 systems
    are several times slower than the few matrix products this needs.
    """
    size = a.size(-1)

    eye = torch.eye(min(size, block_size), dtype=a.dtype, device=a.device)

    if size <= block_size or size % block_size != 0:
        eye = torch.eye(size, dtype=a.dtype, device=a.device)

        return torch.linalg.solve_triangular(a, eye.expand_as(a), upper=False, unitriangular=True)

    num_blocks = size // block_size

    # (..., C, C) -> (..., C / bs, bs, bs)
    diag = a.unflatten(-2, (num_blocks, block_size)).unflatten(-1, (num_blocks, block_size))
    diag = diag.diagonal(dim1=-4, dim2=-2).movedim(-1, -3)

    diag_inv = torch.linalg.solve_triangular(
        diag, eye.expand_as(diag), upper=False, unitriangular=True
    )

    inv = a.new_zeros(a.shape)

    inv[..., :block_size, :block_size] = diag_inv[..., 0, :, :]

    for block in range(1, num_blocks):
        begin, end = block * block_size, (block + 1) * block_size

        # Row block `i` of `(I + L) X = I` left of the diagonal:
        # X[i, :i] = -X[i, i] L[i, :i] X[:i, :i].
        inv[..., begin:end, :begin] = -(
            diag_inv[..., block, :, :] @ (a[..., begin:end, :begin] @ inv[..., :begin, :begin])
        )

        inv[..., begin:end, begin:end] = diag_inv[..., block, :, :]

    return inv


def _addmm(c: Tensor, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
    """``c + alpha * a @ b`` for ``[..., M, N]`` batches of the same shape, as
    one fused GEMM."""
    return torch.baddbmm(
        c.flatten(0, -3), a.flatten(0, -3), b.flatten(0, -3), alpha=alpha
    ).view(c.shape)


@final
@dataclass
class _ChunkTerms:
    """What the forward and the backward both compute from the chunked
    inputs; ``[NC, H, G, ...]`` (``G = 1`` for ``kk``, ``qk``)."""

    exp_gamma: Tensor
    """``[..., C]``: the decay since the chunk start."""

    exp_to_end: Tensor
    """``[..., C]``: the decay until the chunk end."""

    decay: Tensor
    """``[..., C, C]``: ``D``, the decay from ``j`` to ``i``."""

    kk: Tensor
    """``[..., C, C]``: ``K K^T``."""

    qk: Tensor
    """``[..., C, C]``: ``Q K^T``."""

    @staticmethod
    def compute(q: Tensor, k: Tensor, g: Tensor) -> _ChunkTerms:
        """``q``, ``k``: ``[NC, H, 1, C, K]``; ``g``: ``[NC, H, G, C]``."""
        chunk_size = q.size(-2)

        # Summed in fp32 (or fp64): the decays are differences of these sums,
        # always with exponents <= 0.
        gamma = g.cumsum(-1)

        exp_gamma = _exp_(gamma.clone())

        exp_to_end = _exp_(gamma[..., -1:] - gamma)

        causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()

        # Masked before `exp`, so no exponent is positive.
        decay = _exp_((gamma[..., :, None] - gamma[..., None, :]).masked_fill_(~causal, -math.inf))

        return _ChunkTerms(exp_gamma, exp_to_end, decay, k @ k.mT, q @ k.mT)


def _exp_(x: Tensor) -> Tensor:
    """``exp(x)`` in place, for ``x <= 0``; in fp32, decays below ``e^-30``
    become 0.

    Such terms are 10^-6 of fp32's resolution next to undecayed ones, but
    multiplying them yields subnormal floats, which x86 CPUs compute with two
    orders of magnitude slower: with strong decay the whole op ran twice as
    slow. fp64 (gradient checks) stays exact.
    """
    if x.dtype == torch.float32:
        F.threshold_(x, _MIN_FP32_EXPONENT, -math.inf)

    return x.exp_()


def _normalize(x: Tensor, use_l2norm: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """Returns ``x`` in ``dtype``, L2-normalized if asked, with its inverse
    norm."""
    x = x.to(dtype)

    if not use_l2norm:
        return x, None

    rstd = torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)

    return x * rstd, rstd


def _normalize_backward(dy: Tensor, y: Tensor, rstd: Tensor | None) -> Tensor:
    """The gradient of :func:`_normalize` given its output ``y``."""
    if rstd is None:
        return dy

    return rstd * (dy - y * (dy * y).sum(-1, keepdim=True))


def _sum_groups(x: Tensor) -> Tensor:
    """Sums ``[NC, H, G, ...]`` over the value heads of each query/key head."""
    return x if x.size(2) == 1 else x.sum(2, keepdim=True)


def _chunk_inputs(
    layout: _ChunkLayout,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[Tensor, ...]:
    """Returns the chunked ``q``, ``k``, ``v``, ``g``, ``beta`` in the
    compute dtype, and the normalized ``q``, ``k`` with their inverse norms
    (what the backward of the normalization needs)."""
    num_heads = q.size(2)

    dtype = compute_dtype(v)

    qn, q_rstd = _normalize(q, use_qk_l2norm, dtype)
    kn, k_rstd = _normalize(k, use_qk_l2norm, dtype)

    qc = layout.split_heads(qn * scale, num_heads)
    kc = layout.split_heads(kn, num_heads)

    vc, gc, bc = (layout.split_heads(t.to(dtype), num_heads) for t in (v, g, beta))

    return qc, kc, vc, gc, bc, qn, q_rstd, kn, k_rstd


class _ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """Keeps the inputs and, each the size of ``v`` (for ``C = K = V``), the
    chunk-start states, ``(I + A)^-1`` and the writes ``Vn``; the backward
    recomputes the rest."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        initial_state: Tensor | None,
        scale: float,
        use_qk_l2norm: bool,
        output_final_state: bool,
        layout: _ChunkLayout,
    ) -> tuple[Tensor, Tensor | None]:
        batch_size, _, num_heads, key_dim = q.shape

        qc, kc, vc, gc, bc, *_ = _chunk_inputs(layout, q, k, v, g, beta, scale, use_qk_l2norm)

        terms = _ChunkTerms.compute(qc, kc, gc)

        # With `E = diag(exp(gamma))`, `A = E A0 E^-1` for the decay-free
        # `A0 = tril(diag(beta) K K^T, -1)` (the diagonal is not read), so
        # `(I + A)^-1 = D * (I + A0)^-1`. Inverting `I + A0` instead of
        # `I + A` keeps the products of the inversion away from the tiny,
        # even subnormal, values that strong decays give.
        inv = _invert_unit_lower(terms.kk * bc[..., None]).mul_(terms.decay)

        u = inv @ vc.mul_(bc[..., None])
        w = inv @ (kc * (bc * terms.exp_gamma)[..., None])

        kd = kc * terms.exp_to_end[..., None]

        chunk_decay = terms.exp_gamma[..., -1, None, None]

        # (N, H, G, K, V), the rows in the order the layout runs them.
        if initial_state is None:
            state = vc.new_zeros((layout.num_seqs,) + vc.shape[1:3] + (key_dim, vc.size(-1)))
        else:
            state = layout.to_rows(initial_state.to(vc.dtype).unflatten(1, (num_heads, -1)))

        # Sequences without any chunk end where they start.
        starts, writes, finals = [], [], [state[layout.first_step_size :]]

        for begin, end, next_size in layout.step_bounds():
            state = state[: end - begin]

            vn = _addmm(u[begin:end], w[begin:end], state, alpha=-1.0)

            starts.append(state)
            writes.append(vn)

            state = _addmm(chunk_decay[begin:end] * state, kd[begin:end].mT, vn)

            finals.append(state[next_size:])

        s = torch.cat(starts)
        vn = torch.cat(writes)

        # `Q K^T * D`, in place: the decay is not needed anymore.
        p = terms.decay.mul_(terms.qk)

        oc = _addmm((qc * terms.exp_gamma[..., None]) @ s, p, vn)

        o = layout.merge_heads(oc, batch_size).to(v.dtype)

        final_state: Tensor | None = None

        if output_final_state:
            # Rows that stop later have lower ranks.
            final_state = layout.to_seqs(torch.cat(finals[::-1])).flatten(1, 2)

        ctx.save_for_backward(q, k, v, g, beta, initial_state, s, inv, vn)

        ctx.scale = scale
        ctx.use_qk_l2norm = use_qk_l2norm
        ctx.layout = layout

        return o, final_state

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, do: Tensor, dht: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        q, k, v, g, beta, initial_state, s, inv, vn = ctx.saved_tensors

        layout: _ChunkLayout = ctx.layout

        batch_size, _, num_heads, _ = q.shape

        qc, kc, vc, gc, bc, qn, q_rstd, kn, k_rstd = _chunk_inputs(
            layout, q, k, v, g, beta, ctx.scale, ctx.use_qk_l2norm
        )

        doc = layout.split_heads(do.to(vc.dtype), num_heads)

        terms = _ChunkTerms.compute(qc, kc, gc)

        exp_gamma, decay = terms.exp_gamma, terms.decay

        kb_scale = bc * exp_gamma

        w = inv @ (kc * kb_scale[..., None])

        kd = kc * terms.exp_to_end[..., None]

        chunk_decay = exp_gamma[..., -1, None, None]

        qg = qc * exp_gamma[..., None]

        # What the output contributes directly to the gradients of the
        # chunk-start states and of the writes.
        ds_out = qg.mT @ doc
        dvn_out = (decay * terms.qk).mT @ doc

        del qg

        state_shape = s.shape[1:]

        if dht is None:
            dht_rows = None
        else:
            dht_rows = layout.to_rows(dht.to(s.dtype).unflatten(1, (num_heads, -1)))

        def final_grads(begin: int, end: int) -> Tensor:
            if dht_rows is None:
                return s.new_zeros((end - begin,) + state_shape)

            return dht_rows[begin:end]

        # The gradients of the state at every chunk end and of the writes.
        dstate = s.new_zeros((0,) + state_shape)

        end_grads, write_grads = [], []

        for begin, end, next_size in reversed(layout.step_bounds()):
            if end - begin > next_size:
                dstate = torch.cat([dstate, final_grads(next_size, end - begin)])

            dvn = _addmm(dvn_out[begin:end], kd[begin:end], dstate)

            end_grads.append(dstate)
            write_grads.append(dvn)

            dstate = _addmm(
                torch.addcmul(ds_out[begin:end], chunk_decay[begin:end], dstate),
                w[begin:end].mT,
                dvn,
                alpha=-1.0,
            )

        dh0 = torch.cat([dstate, final_grads(layout.first_step_size, layout.num_seqs)])

        ds_end = torch.cat(end_grads[::-1])
        dvn = torch.cat(write_grads[::-1])

        del ds_out, dvn_out, end_grads, write_grads

        # `O = diag(exp(gamma)) Q S + P Vn`
        dqg = doc @ s.mT
        dp = doc @ vn.mT

        # `S' = exp(gamma_C) S + Kd^T Vn`
        dkd = vn @ ds_end.mT

        # `[U | W] = inv [diag(beta) V | diag(beta exp(gamma)) K]` with
        # `Vn = U - W S`, so `dU = dVn`, `dW = -dVn S^T` and
        # `dA = -inv^T (dU U^T + dW W^T) = -inv^T dVn Vn^T`.
        dvb = inv.mT @ dvn

        # Both negated: `-dW'` and `-dA` (strictly lower).
        dkb_neg = dvb @ s.mT
        da_neg = (dvb @ vn.mT).tril_(-1)

        dkb_k = torch.linalg.vecdot(dkb_neg, kc)

        # `-dA * D`, then `-d(K K^T)` per value head, in place.
        da_neg.mul_(decay)

        dad_kk = da_neg * terms.kk

        dbeta = torch.linalg.vecdot(dvb, vc) - exp_gamma * dkb_k - dad_kk.sum(-1)

        dkk_neg = _sum_groups(da_neg.mul_(bc[..., None]))

        # `dP * D`, the gradient of `Q K^T` per value head, in place.
        dpd = dp.mul_(decay)

        # `dL/d(gamma_i - gamma_j)` through `D`: `dA * A + dP * P`.
        de = dad_kk.mul_(bc[..., None]).neg_().addcmul_(dpd, terms.qk)

        dkd_kd = torch.linalg.vecdot(dkd, kd)

        dgamma = exp_gamma * (torch.linalg.vecdot(dqg, qc) - bc * dkb_k) - dkd_kd + de.sum(-1) - de.sum(-2)

        dgamma[..., -1] += dkd_kd.sum(-1) + chunk_decay[..., 0, 0] * torch.linalg.vecdot(
            s.flatten(-2), ds_end.flatten(-2)
        )

        # `gamma` is a cumulative sum.
        dg = dgamma.flip(-1).cumsum(-1).flip(-1)

        dqk = _sum_groups(dpd)

        dqc = dqk @ kc + _sum_groups(dqg.mul_(exp_gamma[..., None]))

        dkc = (
            dqk.mT @ qc
            - (dkk_neg + dkk_neg.mT) @ kc
            + _sum_groups(dkd.mul_(terms.exp_to_end[..., None]).sub_(dkb_neg.mul_(kb_scale[..., None])))
        )

        dq = _normalize_backward(layout.merge_heads(dqc, batch_size) * ctx.scale, qn, q_rstd)
        dk = _normalize_backward(layout.merge_heads(dkc, batch_size), kn, k_rstd)

        dh0_out: Tensor | None = None

        if initial_state is not None and ctx.needs_input_grad[5]:
            dh0_out = layout.to_seqs(dh0).flatten(1, 2).to(initial_state.dtype)

        return (
            dq.to(q.dtype),
            dk.to(k.dtype),
            layout.merge_heads(dvb.mul_(bc[..., None]), batch_size).to(v.dtype),
            layout.merge_heads(dg, batch_size).to(g.dtype),
            layout.merge_heads(dbeta, batch_size).to(beta.dtype),
            dh0_out,
            None,
            None,
            None,
            None,
        )
