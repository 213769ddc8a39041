"""The token-by-token gated delta rule: the reference every faster path is
tested against, and the decoding step."""

from __future__ import annotations

import torch
from torch import Tensor

from qwen35_fs2.ops.delta_rule.common import (
    check_delta_rule_inputs,
    compute_dtype,
    expand_qk_heads,
    l2_normalize,
    sequence_lengths,
)
from qwen35_fs2.ops.varlen import VarlenMetadata


def recurrent_gated_delta_rule(
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
) -> tuple[Tensor, Tensor | None]:
    """Computes the gated delta rule one token at a time, in fp32 (fp64 for
    fp64 inputs).

    For every value head, with state ``S`` of shape ``[K, V]``::

        S   = exp(g_t) * S
        S   = S + k_t (beta_t * (v_t - S^T k_t))^T
        o_t = S^T (scale * q_t)

    :param q: Queries of shape ``[B, T, H, K]``.
    :param k: Keys of shape ``[B, T, H, K]``.
    :param v: Values of shape ``[B, T, HV, V]``; ``HV`` must be a multiple of
        ``H`` and value head ``j`` reads query/key head ``j // (HV // H)``.
    :param g: Log decays (``<= 0``) of shape ``[B, T, HV]``.
    :param beta: Write strengths of shape ``[B, T, HV]``.
    :param scale: Query scale; ``K ** -0.5`` if ``None``.
    :param initial_state: States of shape ``[N, HV, K, V]`` to start from.
    :param output_final_state: If ``True``, returns the final states.
    :param cu_seqlens: Cumulative document lengths ``[N + 1]`` of a packed
        batch (``B`` must be 1); the state restarts at every document.
    :param use_qk_l2norm: If ``True``, L2-normalizes ``q`` and ``k`` first.

    :returns: The output of shape ``[B, T, HV, V]`` in the dtype of ``v``, and
        the final states of shape ``[N, HV, K, V]`` in fp32 (or ``None``).
    """
    check_delta_rule_inputs(q, k, v, g, beta, initial_state, cu_seqlens)

    batch_size, seq_len, _, key_dim = q.shape

    num_v_heads, value_dim = v.shape[2], v.shape[3]

    varlen = None if cu_seqlens is None else VarlenMetadata.of(cu_seqlens)

    lengths = sequence_lengths(batch_size, seq_len, varlen)

    if scale is None:
        scale = key_dim**-0.5

    out_dtype, dtype = v.dtype, compute_dtype(v)

    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))

    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)

    q, k = expand_qk_heads(q, num_v_heads), expand_qk_heads(k, num_v_heads)

    q = q * scale

    if initial_state is None:
        state = q.new_zeros((len(lengths), num_v_heads, key_dim, value_dim))
    else:
        state = initial_state.to(dtype)

    if cu_seqlens is None:
        # The rows of a regular batch step together.
        o, final_state = _recur(q, k, v, g, beta, state)
    else:
        outputs, final_states = [], []

        begin = 0

        for seq_idx, length in enumerate(lengths):
            end = begin + length

            seq_o, seq_state = _recur(
                q[:, begin:end],
                k[:, begin:end],
                v[:, begin:end],
                g[:, begin:end],
                beta[:, begin:end],
                state[seq_idx : seq_idx + 1],
            )

            outputs.append(seq_o)

            final_states.append(seq_state)

            begin = end

        o, final_state = torch.cat(outputs, dim=1), torch.cat(final_states)

    return o.to(out_dtype), (final_state if output_final_state else None)


def _recur(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """Runs the recurrence over ``T`` for sequences of equal length, from
    ``state`` of shape ``[N, HV, K, V]``; ``q``, ``k`` already have ``HV``
    heads."""
    outputs = []

    for t in range(q.size(1)):
        state = state * g[:, t].exp()[:, :, None, None]

        # (N, HV, K) x (N, HV, K, V) -> (N, HV, V)
        kv_mem = torch.einsum("nhk,nhkv->nhv", k[:, t], state)

        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]

        state = state + k[:, t, :, :, None] * delta[:, :, None, :]

        outputs.append(torch.einsum("nhk,nhkv->nhv", q[:, t], state))

    if not outputs:
        return v.new_zeros(v.shape), state

    return torch.stack(outputs, dim=1), state
