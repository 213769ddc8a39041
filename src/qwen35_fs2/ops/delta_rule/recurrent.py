"""The token-by-token gated delta rule: the reference every faster path is
tested against, and the decoding step."""

from __future__ import annotations

import torch
from torch import Tensor

from qwen35_fs2.ops.delta_rule.common import (
    check_delta_rule_inputs,
    expand_qk_heads,
    l2_normalize,
)


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
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Computes the gated delta rule one token at a time, in fp32.

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

    if scale is None:
        scale = key_dim**-0.5

    dtype = v.dtype

    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))

    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)

    q, k = expand_qk_heads(q, num_v_heads), expand_qk_heads(k, num_v_heads)

    q = q * scale

    if cu_seqlens is None:
        bounds = [(b, 0, seq_len) for b in range(batch_size)]
    else:
        offsets = cu_seqlens.tolist()

        bounds = [(0, offsets[i], offsets[i + 1]) for i in range(len(offsets) - 1)]

    o = torch.zeros_like(v)

    final_states = []

    for seq_idx, (b, begin, end) in enumerate(bounds):
        if initial_state is None:
            state = q.new_zeros((num_v_heads, key_dim, value_dim))
        else:
            state = initial_state[seq_idx].float()

        for t in range(begin, end):
            state = state * g[b, t].exp()[:, None, None]

            # (HV, K) x (HV, K, V) -> (HV, V)
            kv_mem = torch.einsum("hk,hkv->hv", k[b, t], state)

            delta = (v[b, t] - kv_mem) * beta[b, t][:, None]

            state = state + k[b, t][:, :, None] * delta[:, None, :]

            o[b, t] = torch.einsum("hk,hkv->hv", q[b, t], state)

        final_states.append(state)

    final_state = torch.stack(final_states) if output_final_state else None

    return o.to(dtype), final_state
