"""The chunked gated delta rule in plain PyTorch, with a hand-written backward.

Shape letters: ``B`` batch, ``T`` tokens, ``H`` query/key heads, ``HV`` value
heads, ``G = HV // H`` value heads per query/key head, ``K`` key dim, ``V``
value dim, ``N`` sequences, ``NC`` chunks (of all sequences), ``C`` chunk
size.

Within a chunk, with ``gamma`` the cumulative log decay since the chunk
start, ``D[i, j] = exp(gamma_i - gamma_j)`` for ``i >= j`` (``0`` above) and
``S`` the state at the chunk start, the ``C`` delta-rule updates collapse
into (the WY representation, a unit lower-triangular system)::

    A     = tril(diag(beta) (K K^T * D), -1)
    [U|W] = (I + A)^-1 [diag(beta) V | diag(beta exp(gamma)) K]
    Vn    = U - W S                       # what the chunk writes
    O     = diag(exp(gamma)) Q S + tril(Q K^T * D) Vn
    S'    = exp(gamma_C) S + (diag(exp(gamma_C - gamma)) K)^T Vn

Everything but the ``S -> S'`` recurrence runs for all chunks at once. Every
exponent is a difference ``gamma_i - gamma_j`` with ``i >= j``, masked before
``exp``: strong decays underflow to 0 and never overflow.

The backward recomputes the intra-chunk terms; it keeps from the forward the
chunk-start states, ``(I + A)^-1`` and ``Vn``, three tensors of the size of
``v`` (for ``C = K = V``), where autograd would keep some twenty.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final, final

import torch
from torch import Tensor

from qwen35_fs2.ops.autocast import autocast_free
from qwen35_fs2.ops.delta_rule.common import (
    check_delta_rule_inputs,
    compute_dtype,
    l2_inverse_norm,
    sequence_lengths,
)
from qwen35_fs2.ops.varlen import VarlenMetadata

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
    cu_seqlens: Tensor | VarlenMetadata | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """Computes the gated delta rule chunk by chunk (the training path).

    Same contract as :func:`recurrent_gated_delta_rule`. The documents of a
    packed batch are cut into chunks of their own (a chunk never straddles
    two documents), so nothing leaks from one document to the next.

    Under ``torch.compile``, a regular batch traces into one graph; with
    ``cu_seqlens``, the kernel runs as the operator
    ``qwen35_fs2::packed_chunk_gated_delta_rule``
    (:mod:`~qwen35_fs2.ops.packed_ops`), so that the graph does not
    specialize on the documents' lengths. Given as a tensor, ``cu_seqlens``
    is read on the host (a device synchronization, and a graph break); given
    as :class:`VarlenMetadata`, its host copy is used, and in eager mode the
    chunk layout is built once per metadata (once per batch for all layers
    of a model).

    :param chunk_size: The number of tokens solved together; 64 matches fla
        (32 is a few percent faster on CPU, but loops twice as often).

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

    if cu_seqlens is None:
        layout = _ChunkLayout.regular(batch_size, seq_len, chunk_size)
    else:
        varlen = VarlenMetadata.of(cu_seqlens)

        if torch.compiler.is_compiling() and seq_len > 0:
            # Imported here: the operators run this module's kernels.
            from qwen35_fs2.ops.packed_ops import packed_chunk_gated_delta_rule

            o, final_state, _, _, _ = packed_chunk_gated_delta_rule(
                q, k, v, g, beta, initial_state, varlen.cu_seqlens_cpu,
                scale, use_qk_l2norm, output_final_state, chunk_size,
            )  # fmt: skip

            return o, final_state if output_final_state else None

        lengths = sequence_lengths(batch_size, seq_len, varlen)

        layout = varlen.derived(
            ("delta_rule_chunks", chunk_size, q.device),
            lambda: _ChunkLayout.packed(lengths, chunk_size, q.device),
        )

    if layout.num_chunks == 0:
        return _empty_outputs(v, initial_state, output_final_state, layout.num_seqs, key_dim)

    o, final_state = _ChunkGatedDeltaRuleFunction.apply(  # type: ignore[no-untyped-call]
        q, k, v, g, beta, initial_state, scale, use_qk_l2norm, output_final_state, layout
    )

    return o, final_state


def _empty_outputs(
    v: Tensor,
    initial_state: Tensor | None,
    output_final_state: bool,
    num_seqs: int,
    key_dim: int,
) -> tuple[Tensor, Tensor | None]:
    """The outputs for ``T = 0``: nothing, and the states unchanged (both
    still in the autograd graph)."""
    o = v.clone()

    if not output_final_state:
        return o, None

    dtype = compute_dtype(v)

    if initial_state is None:
        return o, v.new_zeros((num_seqs, v.size(2), key_dim, v.size(3)), dtype=dtype)

    return o, initial_state.to(dtype)


@final
@dataclass(frozen=True)
class _ChunkLayout:
    """Where every token sits once its sequence is cut into chunks.

    Chunks are ordered by their index within their sequence, then by
    sequence, the sequences sorted by decreasing chunk count: the chunks of
    the ``j``-th step of the recurrence are then contiguous, and so are the
    states of the sequences still running (a prefix of the state rows).
    """

    chunk_size: int

    num_seqs: int

    seq_len: int
    """``T``, the length of the rows of the batch."""

    step_sizes: tuple[int, ...]
    """The number of sequences with a ``j``-th chunk, non-increasing."""

    token_slots: Tensor | None
    """``[T]``: the chunk slot (``chunk * C + offset``) of every token of a
    packed batch; ``None`` for a regular batch, whose rows are only cut (a
    strided copy, much faster than a gather on CPU)."""

    seq_order: Tensor | None
    """``[N]``: the sequence of each state row; ``None`` if in order."""

    seq_ranks: Tensor | None
    """``[N]``: the state row of each sequence (the inverse of ``seq_order``)."""

    @staticmethod
    def regular(batch_size: int, seq_len: int, chunk_size: int) -> _ChunkLayout:
        num_chunks = -(-seq_len // chunk_size)

        step_sizes = (batch_size,) * num_chunks

        return _ChunkLayout(chunk_size, batch_size, seq_len, step_sizes, None, None, None)

    @staticmethod
    def packed(lengths: list[int], chunk_size: int, device: torch.device) -> _ChunkLayout:
        num_seqs = len(lengths)

        num_chunks = [-(-length // chunk_size) for length in lengths]

        # A stable sort: a batch of equal lengths keeps its order.
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

        if order == sorted(order):
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
        """``(begin, end, next_size)``: the chunks of every recurrence step, and
        the number of sequences still running after it."""
        bounds = []

        begin = 0

        for step, step_size in enumerate(self.step_sizes):
            next_size = self.step_sizes[step + 1] if step + 1 < len(self.step_sizes) else 0

            bounds.append((begin, begin + step_size, next_size))

            begin += step_size

        return bounds

    def split_heads(self, x: Tensor, num_heads: int, dtype: torch.dtype) -> Tensor:
        """``[B, T, HV, *F]`` -> ``[NC, H, G, C, *F]`` in ``dtype`` (``G = 1``
        if ``x`` has ``H`` heads), zeros past the end of every sequence.

        Always a new tensor, which callers may modify in place.
        """
        num_v_heads, features = x.size(2), x.shape[3:]

        shape = (self.num_chunks, num_heads, num_v_heads // num_heads, self.chunk_size) + features

        if self.token_slots is not None:
            slots = x.new_zeros((self.num_chunks * self.chunk_size, num_v_heads) + features, dtype=dtype)

            slots.index_copy_(0, self.token_slots, x.flatten(0, 1).to(dtype))

            # (NC x C, HV, *F) -> (NC, HV, C, *F)
            slots = slots.view((self.num_chunks, self.chunk_size, num_v_heads) + features)

            return slots.transpose(1, 2).reshape(shape)

        batch_size = x.size(0)

        pad = len(self.step_sizes) * self.chunk_size - self.seq_len

        if pad > 0:
            x = torch.cat([x, x.new_zeros((batch_size, pad) + x.shape[2:])], dim=1)

        # (B, NC / B, C, HV, *F) -> (NC / B, B, HV, C, *F)
        x = x.view((batch_size, -1, self.chunk_size) + x.shape[2:]).movedim(0, 1).transpose(2, 3)

        return x.new_empty(x.shape, dtype=dtype).copy_(x).view(shape)

    def merge_heads(self, x: Tensor, batch_size: int) -> Tensor:
        """The inverse of :meth:`split_heads`, ``[B, T, HV, *F]``."""
        num_chunks, num_heads, group_size, chunk_size = x.shape[:4]

        # (NC, H, G, C, *F) -> (NC, C, HV, *F)
        x = x.view((num_chunks, num_heads * group_size, chunk_size) + x.shape[4:]).transpose(1, 2)

        if self.token_slots is not None:
            return x.flatten(0, 1)[self.token_slots].unsqueeze(0)

        # (NC / B, B, C, HV, *F) -> (B, T, HV, *F)
        x = x.reshape((-1, batch_size) + x.shape[1:]).movedim(1, 0).flatten(1, 2)

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
    them by block forward substitution: on CPU, batched 64 x 64 triangular
    solves are several times slower than the few products this needs.
    """
    size = a.size(-1)

    if size <= block_size or size % block_size != 0:
        block_size = size

    eye = torch.eye(block_size, dtype=a.dtype, device=a.device)

    # (..., C / bs, bs, bs)
    diag = torch.stack(
        [a[..., i : i + block_size, i : i + block_size] for i in range(0, size, block_size)], dim=-3
    )

    diag_inv: Tensor = torch.linalg.solve_triangular(
        diag, eye.expand_as(diag), upper=False, unitriangular=True
    )

    if block_size == size:
        return diag_inv.squeeze(-3)

    inv = a.new_zeros(a.shape)

    for block, begin in enumerate(range(0, size, block_size)):
        end = begin + block_size

        # Row block `i` of `(I + L) X = I`, left of the diagonal:
        # `X[i, :i] = -X[i, i] L[i, :i] X[:i, :i]`.
        if begin > 0:
            inv[..., begin:end, :begin] = -(
                diag_inv[..., block, :, :] @ (a[..., begin:end, :begin] @ inv[..., :begin, :begin])
            )

        inv[..., begin:end, begin:end] = diag_inv[..., block, :, :]

    return inv


def _addmm(c: Tensor, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
    """``c + alpha * a @ b`` for ``[..., M, N]`` batches of one shape, as one
    fused GEMM."""
    out = torch.baddbmm(c.flatten(0, -3), a.flatten(0, -3), b.flatten(0, -3), alpha=alpha)

    return out.view(c.shape)


def _sum_groups(x: Tensor) -> Tensor:
    """Sums ``[NC, H, G, ...]`` over the value heads of each query/key head."""
    return x if x.size(2) == 1 else x.sum(2, keepdim=True)


def _exp_(x: Tensor) -> Tensor:
    """``exp(x)`` in place, for ``x <= 0``; in fp32, decays below ``e^-30``
    become 0.

    Such terms are 10^-6 of fp32's resolution next to undecayed ones, but
    multiplying them yields subnormal floats, two orders of magnitude slower
    to compute with on x86 (strong decays made the whole op twice as slow).
    fp64 (gradient checks) stays exact.
    """
    if x.dtype == torch.float32:
        torch.threshold_(x, _MIN_FP32_EXPONENT, -math.inf)

    return x.exp_()


@final
@dataclass
class _ChunkedInputs:
    """The inputs in the chunk layout and the compute dtype: ``q``, ``k``
    ``[NC, H, 1, C, K]`` (normalized, ``q`` scaled), ``v`` ``[NC, H, G, C,
    V]``, ``g``, ``beta`` ``[NC, H, G, C]``."""

    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor

    q_rstd: Tensor | None
    k_rstd: Tensor | None
    """The inverse norms (``None`` without normalization)."""

    @staticmethod
    def create(
        layout: _ChunkLayout,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        scale: float,
        use_qk_l2norm: bool,
    ) -> _ChunkedInputs:
        num_heads, dtype = q.size(2), compute_dtype(v)

        qc, kc, vc, gc, bc = (layout.split_heads(t, num_heads, dtype) for t in (q, k, v, g, beta))

        if not use_qk_l2norm:
            return _ChunkedInputs(qc.mul_(scale), kc, vc, gc, bc, None, None)

        # Padding stays 0.
        q_rstd, k_rstd = l2_inverse_norm(qc), l2_inverse_norm(kc)

        return _ChunkedInputs(qc.mul_(q_rstd * scale), kc.mul_(k_rstd), vc, gc, bc, q_rstd, k_rstd)


def _normalize_backward(dy: Tensor, y: Tensor, rstd: Tensor | None, scale: float) -> Tensor:
    """The gradient of ``x`` for ``y = scale * x * rstd(x)`` (``y = scale *
    x`` if ``rstd`` is ``None``), given ``y``; overwrites ``dy``."""
    if rstd is None:
        return dy.mul_(scale)

    # `dx = rstd * (scale * dy - y_hat (y_hat . scale * dy))` for the unit
    # `y_hat = y / scale`.
    dot = torch.linalg.vecdot(y, dy).unsqueeze(-1)

    return dy.sub_(y * dot.div_(scale**2)).mul_(rstd * scale)


@final
@dataclass
class _ChunkTerms:
    """What the forward and the backward both compute; ``[NC, H, G, ...]``
    (``G = 1`` for ``kk``, ``qk``)."""

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

    kd: Tensor
    """``[..., C, K]``: ``diag(exp(gamma_C - gamma)) K``."""

    kb_scale: Tensor
    """``[..., C]``: ``beta exp(gamma)``, the row scales of ``K`` in ``W``."""

    @staticmethod
    def compute(x: _ChunkedInputs) -> _ChunkTerms:
        chunk_size = x.q.size(-2)

        dtype = x.g.dtype

        # Summed in fp64: the decays are differences of these sums, which
        # reach -10^3 or more under strong decay, where fp32 differences would
        # lose 4 digits.
        gamma = x.g.to(torch.float64).cumsum(-1)

        exp_gamma = _exp_(gamma.to(dtype, copy=True))

        exp_to_end = _exp_((gamma[..., -1:] - gamma).to(dtype))

        causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=gamma.device).tril()

        decay = (gamma[..., :, None] - gamma[..., None, :]).to(dtype).masked_fill_(~causal, -math.inf)

        return _ChunkTerms(
            exp_gamma,
            exp_to_end,
            _exp_(decay),
            x.k @ x.k.mT,
            x.q @ x.k.mT,
            x.k * exp_to_end[..., None],
            x.beta * exp_gamma,
        )


@autocast_free
def chunk_forward(
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
) -> tuple[Tensor, Tensor | None, Tensor, Tensor, Tensor]:
    """The forward pass of :func:`chunk_gated_delta_rule` over ``layout``.

    :returns: The output and the final states (or ``None``), and what
        :func:`chunk_backward` needs besides the inputs: the chunk-start
        states ``[NC, H, G, K, V]``, ``(I + A)^-1`` ``[NC, H, G, C, C]`` and
        ``Vn`` ``[NC, H, G, C, V]``.
    """
    x = _ChunkedInputs.create(layout, q, k, v, g, beta, scale, use_qk_l2norm)

    terms = _ChunkTerms.compute(x)

    # With `E = diag(exp(gamma))`, `A = E A0 E^-1` for the decay-free
    # `A0 = tril(diag(beta) K K^T, -1)` (the diagonal is not read), so
    # `(I + A)^-1 = D * (I + A0)^-1`. Inverting `I + A0` keeps the
    # inversion away from the tiny, even subnormal, products of decays.
    inv = _invert_unit_lower(terms.kk * x.beta[..., None]).mul_(terms.decay)

    u = inv @ x.v.mul_(x.beta[..., None])
    w = inv @ (x.k * terms.kb_scale[..., None])

    chunk_decay = terms.exp_gamma[..., -1, None, None]

    # (N, H, G, K, V), the rows in the order the layout runs them.
    if initial_state is None:
        state = u.new_zeros((layout.num_seqs,) + u.shape[1:3] + (w.size(-1), u.size(-1)))
    else:
        state = layout.to_rows(initial_state.to(u.dtype).view((-1,) + u.shape[1:3] + initial_state.shape[2:]))

    # Sequences without any chunk end where they start.
    starts, writes, finals = [], [], [state[layout.first_step_size :]]

    for begin, end, next_size in layout.step_bounds():
        state = state[: end - begin]

        vn = _addmm(u[begin:end], w[begin:end], state, alpha=-1.0)

        starts.append(state)
        writes.append(vn)

        state = _addmm(chunk_decay[begin:end] * state, terms.kd[begin:end].mT, vn)

        finals.append(state[next_size:])

    s, vn = torch.cat(starts), torch.cat(writes)

    # `P = Q K^T * D`, in place: the decay is not needed anymore.
    p = terms.decay.mul_(terms.qk)

    oc = _addmm((x.q * terms.exp_gamma[..., None]) @ s, p, vn)

    o = layout.merge_heads(oc, q.size(0)).to(v.dtype)

    final_state: Tensor | None = None

    if output_final_state:
        # Rows that stop later have lower ranks.
        final_state = layout.to_seqs(torch.cat(finals[::-1])).flatten(1, 2)

    return o, final_state, s, inv, vn


@autocast_free
def chunk_backward(
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
    scale: float,
    use_qk_l2norm: bool,
    layout: _ChunkLayout,
    initial_state_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """The backward pass of :func:`chunk_forward`, which recomputes the
    intra-chunk terms from the inputs.

    :param initial_state_grad: If ``False``, the gradient of
        ``initial_state`` is ``None``.

    :returns: The gradients of ``q``, ``k``, ``v``, ``g``, ``beta`` (in
        their dtypes) and ``initial_state``.
    """

    batch_size, num_heads = q.size(0), q.size(2)

    x = _ChunkedInputs.create(layout, q, k, v, g, beta, scale, use_qk_l2norm)

    doc = layout.split_heads(do, num_heads, s.dtype)

    terms = _ChunkTerms.compute(x)

    exp_gamma, decay = terms.exp_gamma, terms.decay

    w = inv @ (x.k * terms.kb_scale[..., None])

    chunk_decay = exp_gamma[..., -1, None, None]

    # What the output contributes directly to the gradients of the
    # chunk-start states and of the writes.
    ds_out = (x.q * exp_gamma[..., None]).mT @ doc
    dvn_out = (decay * terms.qk).mT @ doc

    state_shape = s.shape[1:]

    if dht is None:
        dht_rows = s.new_zeros((layout.num_seqs,) + state_shape)
    else:
        dht_rows = layout.to_rows(dht.to(s.dtype).view((-1,) + state_shape))

    # The gradients of the state at every chunk end, and of the writes.
    dstate = s.new_zeros((0,) + state_shape)

    end_grads, write_grads = [], []

    for begin, end, next_size in reversed(layout.step_bounds()):
        if end - begin > next_size:
            dstate = torch.cat([dstate, dht_rows[next_size : end - begin]])

        dvn = _addmm(dvn_out[begin:end], terms.kd[begin:end], dstate)

        end_grads.append(dstate)
        write_grads.append(dvn)

        dstate = torch.addcmul(ds_out[begin:end], chunk_decay[begin:end], dstate)
        dstate = _addmm(dstate, w[begin:end].mT, dvn, alpha=-1.0)

    dh0 = torch.cat([dstate, dht_rows[layout.first_step_size :]])

    ds_end, dvn = torch.cat(end_grads[::-1]), torch.cat(write_grads[::-1])

    # Dropped as soon as used: the backward's peak is its largest cost
    # in memory.
    del ds_out, dvn_out, end_grads, write_grads, w, dht_rows

    # `O = diag(exp(gamma)) Q S + P Vn`; `dP` is masked by `D` below.
    dqg = doc @ s.mT
    dp = doc @ vn.mT

    del doc

    # `S' = exp(gamma_C) S + Kd^T Vn`
    dkd = vn @ ds_end.mT

    dchunk_decay = (s * ds_end).sum((-2, -1))

    del ds_end

    # `[U | W] = inv [diag(beta) V | diag(beta exp(gamma)) K]` and
    # `Vn = U - W S`: `dU = dVn`, `dW = -dVn S^T`, and so
    # `dA = -inv^T (dU U^T + dW W^T) = -inv^T dVn Vn^T`.
    dvb = inv.mT @ dvn

    del dvn

    # Both negated: `-d(diag(beta exp(gamma)) K)` and `-dA`.
    dkb_neg = dvb @ s.mT
    da_neg = (dvb @ vn.mT).tril_(-1)

    dkb_k = torch.linalg.vecdot(dkb_neg, x.k)

    # `-dA * D`, the decay-free gradient `-d(diag(beta) K K^T)`.
    da_neg.mul_(decay)

    dad_kk = da_neg * terms.kk

    dbeta = torch.linalg.vecdot(dvb, x.v) - exp_gamma * dkb_k - dad_kk.sum(-1)

    dv = dvb.mul_(x.beta[..., None])

    # `-d(K K^T)` and `d(Q K^T)`, per query/key head.
    dkk_neg = _sum_groups(da_neg.mul_(x.beta[..., None]))

    dpd = dp.mul_(decay)

    dqk = _sum_groups(dpd)

    # `dL/d(gamma_i - gamma_j)` through `D`: `dA * A + dP * P`.
    de = dad_kk.mul_(x.beta[..., None]).neg_().addcmul_(dpd, terms.qk)

    del da_neg, dp, dpd

    # `gamma_i` is the sum of `g_t` for `t <= i`: what flows through
    # `exp(gamma_i)` reaches every `g_t` with `t <= i`.
    dgamma = exp_gamma * (torch.linalg.vecdot(dqg, x.q) - x.beta * dkb_k)
    dgamma += de.sum(-1) - de.sum(-2)

    dgamma[..., -1] += chunk_decay[..., 0, 0] * dchunk_decay

    del de, dad_kk

    dg = dgamma.flip(-1).cumsum(-1).flip(-1)

    # `exp(gamma_C - gamma_i)` is the sum of `g_t` for `t > i`: what
    # flows through it reaches every `g_t` with `t > i`. Summed apart:
    # through `exp(gamma_C)` and `exp(-gamma_i)` separately, large terms
    # would cancel in fp32.
    dkd_kd = torch.linalg.vecdot(dkd, terms.kd)

    dg[..., 1:] += dkd_kd[..., :-1].cumsum(-1)

    dqc = _addmm(_sum_groups(dqg.mul_(exp_gamma[..., None])), dqk, x.k)

    dkc = _sum_groups(
        dkd.mul_(terms.exp_to_end[..., None]).sub_(dkb_neg.mul_(terms.kb_scale[..., None]))
    )

    dkc = _addmm(dkc, dqk.mT, x.q)
    dkc = _addmm(dkc, dkk_neg + dkk_neg.mT, x.k, alpha=-1.0)

    dqc = _normalize_backward(dqc, x.q, x.q_rstd, scale)
    dkc = _normalize_backward(dkc, x.k, x.k_rstd, 1.0)

    dh0_out: Tensor | None = None

    if initial_state is not None and initial_state_grad:
        dh0_out = layout.to_seqs(dh0).flatten(1, 2).to(initial_state.dtype)

    grads = (
        (dqc, q),
        (dkc, k),
        (dv, v),
        (dg, g),
        (dbeta, beta),
    )

    dq, dk, dv, dg, dbeta = (layout.merge_heads(dx, batch_size).to(t.dtype) for dx, t in grads)

    return dq, dk, dv, dg, dbeta, dh0_out


class _ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """Keeps the chunk-start states, ``(I + A)^-1`` and ``Vn`` for the
    backward, which recomputes the rest from the inputs."""

    @staticmethod
    def forward(
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
        o, final_state, s, inv, vn = chunk_forward(
            q, k, v, g, beta, initial_state, scale, use_qk_l2norm, output_final_state, layout
        )

        ctx.save_for_backward(q, k, v, g, beta, initial_state, s, inv, vn)

        ctx.scale = scale
        ctx.use_qk_l2norm = use_qk_l2norm
        ctx.layout = layout

        return o, final_state

    @staticmethod
    def backward(
        ctx: Any, do: Tensor, dht: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        q, k, v, g, beta, initial_state, s, inv, vn = ctx.saved_tensors

        grads = chunk_backward(
            q, k, v, g, beta, initial_state, s, inv, vn, do, dht,
            ctx.scale, ctx.use_qk_l2norm, ctx.layout, ctx.needs_input_grad[5],
        )  # fmt: skip

        return grads + (None, None, None, None)
