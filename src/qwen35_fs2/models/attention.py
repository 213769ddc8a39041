"""Gated full attention of the Qwen3.5 hybrid decoder."""

from __future__ import annotations

from collections.abc import Callable
from typing import final

import torch
from torch import Tensor
from typing_extensions import override

from fairseq2.data_type import DataType
from fairseq2.device import Device
from fairseq2.gang import Gangs, get_current_gangs
from fairseq2.models.transformer import (
    SDPA,
    AttentionBiasCache,
    AttentionState,
    FullAttentionState,
    MultiheadAttention,
)
from fairseq2.nn import (
    BatchLayout,
    ColumnShardedLinear,
    IncrementalStateBag,
    LayerNorm,
    Linear,
    PositionEncoder,
    RowShardedLinear,
)
from fairseq2.ops import repeat_interleave


@final
class Qwen35Attention(MultiheadAttention):
    """Grouped-query attention with an output gate, as in Qwen3.5 and
    Qwen3-Next.

    Differences from :class:`~fairseq2.models.transformer.StandardMultiheadAttention`:

    - ``q_proj`` produces, per head, the query followed by a gate of the same
      size (rows ``[q_h0 | g_h0 | q_h1 | g_h1 | ...]``); the attention output
      is multiplied by ``sigmoid(gate)`` before ``output_proj``. Keeping each
      head's two halves adjacent lets tensor parallelism shard by heads.
    - ``q_norm`` and ``k_norm`` are applied before the (partial) rotary
      encoding.
    - No projection has a bias.
    """

    def __init__(
        self,
        model_dim: int,
        num_heads: int,
        num_key_value_heads: int,
        head_dim: int,
        sdpa: SDPA,
        pos_encoder: PositionEncoder,
        q_norm: LayerNorm,
        k_norm: LayerNorm,
        *,
        proj_init_fn: Callable[[Linear], None] | None = None,
        gangs: Gangs | None = None,
        device: Device | None = None,
        dtype: DataType | None = None,
    ) -> None:
        super().__init__()

        if num_heads % num_key_value_heads != 0:
            raise ValueError(
                f"`num_heads` must be a multiple of `num_key_value_heads` ({num_key_value_heads}), but is {num_heads} instead."
            )

        if pos_encoder.encoding_dim != head_dim:
            raise ValueError(
                f"`pos_encoder.encoding_dim` must be equal to `head_dim` ({head_dim}), but is {pos_encoder.encoding_dim} instead."
            )

        if gangs is None:
            gangs = get_current_gangs(device)

        tp_size = gangs.tp.size

        for name, value in (("num_heads", num_heads), ("num_key_value_heads", num_key_value_heads)):
            if value % tp_size != 0:
                raise ValueError(
                    f"`{name}` must be a multiple of the tensor parallel size ({tp_size}), but is {value} instead."
                )

        self.model_dim = model_dim
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.num_query_groups = num_heads // num_key_value_heads

        def make_column_linear(output_dim: int) -> ColumnShardedLinear:
            return ColumnShardedLinear(
                model_dim,
                output_dim,
                bias=False,
                gather_output=False,
                init_fn=proj_init_fn,
                gangs=gangs,
                device=device,
                dtype=dtype,
            )

        self.q_proj = make_column_linear(2 * num_heads * head_dim)
        self.k_proj = make_column_linear(num_key_value_heads * head_dim)
        self.v_proj = make_column_linear(num_key_value_heads * head_dim)

        self.q_norm = q_norm
        self.k_norm = k_norm

        self.pos_encoder = pos_encoder

        self.sdpa = sdpa

        self.output_proj = RowShardedLinear(
            num_heads * head_dim,
            model_dim,
            bias=False,
            scatter_input=False,
            init_fn=proj_init_fn,
            gangs=gangs,
            device=device,
            dtype=dtype,
        )

    @override
    def forward(
        self,
        seqs: Tensor,
        seqs_layout: BatchLayout,
        keys: Tensor,
        keys_layout: BatchLayout,
        values: Tensor,
        bias_cache: AttentionBiasCache,
        *,
        state_bag: IncrementalStateBag | None = None,
    ) -> Tensor:
        """Computes self attention; ``keys`` and ``values`` must be ``seqs``."""
        if keys is not seqs or values is not seqs:
            raise ValueError(
                "`keys` and `values` must be `seqs`: Qwen3.5 attention is self attention only."
            )

        # (N, S, M) -> (N, S, H, 2 x K_h)
        q_and_gate = self.q_proj(seqs).unflatten(-1, (-1, 2 * self.head_dim))

        # (N, S, H, K_h), (N, S, H, K_h)
        q, gate = q_and_gate.split(self.head_dim, dim=-1)

        q = self.pos_encoder(self.q_norm(q), seqs_layout, state_bag=state_bag)

        # (N, S, M) -> (N, S, H_kv, K_h)
        k = self.k_proj(seqs).unflatten(-1, (-1, self.head_dim))
        v = self.v_proj(seqs).unflatten(-1, (-1, self.head_dim))

        k = self.pos_encoder(self.k_norm(k), seqs_layout, state_bag=state_bag)

        if not self.training and state_bag is not None:
            k, v, keys_layout = self._update_state(k, v, seqs_layout, state_bag)

        if self.num_query_groups > 1:
            # (N, S_kv, H_kv, K_h) -> (N, S_kv, H, K_h)
            k = repeat_interleave(k, dim=-2, repeat=self.num_query_groups)
            v = repeat_interleave(v, dim=-2, repeat=self.num_query_groups)

        # (N, S, H, K_h)
        attns, _ = self.sdpa(q, seqs_layout, k, keys_layout, v, bias_cache)

        del q, k, v

        attns = attns * torch.sigmoid(gate)

        # (N, S, H, K_h) -> (N, S, M)
        return self.output_proj(attns.flatten(-2, -1))

    def _update_state(
        self,
        k: Tensor,
        v: Tensor,
        seqs_layout: BatchLayout,
        state_bag: IncrementalStateBag,
    ) -> tuple[Tensor, Tensor, BatchLayout]:
        if seqs_layout.packed or seqs_layout.padded:
            raise ValueError(
                "`seqs` must be neither packed nor padded during incremental decoding."
            )

        state = state_bag.maybe_get_state(self, AttentionState)
        if state is None:
            state = FullAttentionState(
                k, v, state_bag.max_num_steps, state_bag.capacity_increment
            )

            state_bag.set_state(self, state)

            return k, v, seqs_layout

        state.append(k, v)

        # (N, S_kv, H_kv, K_h)
        k, v = state.get()

        return k, v, BatchLayout.of(k)

    @override
    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, "
            f"num_key_value_heads={self.num_key_value_heads}, "
            f"head_dim={self.head_dim}"
        )
