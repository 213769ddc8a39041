"""Gated full attention of the Qwen3.5 hybrid decoder."""

from __future__ import annotations

from collections.abc import Callable
from typing import final

import torch
from torch import Tensor
from torch.nn.functional import linear
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
from fairseq2.ops.tensor_parallel import gather, reduce_on_backward

from qwen35_fs2.compat.attention_mask import run_sdpa
from qwen35_fs2.nn.lora import LoraAdapter
from qwen35_fs2.nn.tp import (
    call_with_tp_summed_gradients,
    check_tp_divisible,
    sum_gradient_over_tp,
)


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

    Under tensor parallelism each rank holds ``num_heads / tp_size`` query
    heads. Key/value heads are sharded alike when ``num_key_value_heads`` is a
    multiple of the tensor parallel size. Otherwise (e.g. 4 key/value heads on
    8 ranks) they are replicated: each rank still stores a contiguous
    ``1 / tp_size`` of the ``k_proj`` and ``v_proj`` rows, so checkpoints
    reshard as for any column-sharded projection, but gathers the weights in
    the forward pass and computes the key/value heads its query heads use;
    the gradients are summed over the ranks, as are those of the shared
    ``q_norm`` and ``k_norm`` weights.
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

        tp_gang = gangs.tp

        check_tp_divisible("num_heads", num_heads, tp_gang)

        self.model_dim = model_dim
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.num_query_groups = num_heads // num_key_value_heads

        self.tp_gang = tp_gang

        self.shard_key_value_heads = num_key_value_heads % tp_gang.size == 0

        # With replicated key/value heads: the first key/value head that the
        # rank's query heads use, and the one each of them uses, counted from
        # it.
        num_local_heads = num_heads // tp_gang.size

        first_head = tp_gang.rank * num_local_heads

        self.first_key_value_head = first_head // self.num_query_groups

        self.key_value_head_indices = [
            (first_head + idx) // self.num_query_groups - self.first_key_value_head
            for idx in range(num_local_heads)
        ]

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

        q = call_with_tp_summed_gradients(self.q_norm, self.tp_gang, q)

        q = self.pos_encoder(q, seqs_layout, state_bag=state_bag)

        # (N, S, M) -> (N, S, H_kv, K_h)
        if self.shard_key_value_heads:
            k = self.k_proj(seqs)
            v = self.v_proj(seqs)
        else:
            k, v = self._project_replicated_key_values(seqs)

        k = k.unflatten(-1, (-1, self.head_dim))
        v = v.unflatten(-1, (-1, self.head_dim))

        k = call_with_tp_summed_gradients(self.k_norm, self.tp_gang, k)

        k = self.pos_encoder(k, seqs_layout, state_bag=state_bag)

        if not self.training and state_bag is not None:
            k, v, keys_layout = self._update_state(k, v, seqs_layout, state_bag)

        if not self.shard_key_value_heads:
            # (N, S_kv, H_kv', K_h) -> (N, S_kv, H, K_h)
            indices = torch.tensor(self.key_value_head_indices, device=k.device)

            k = k.index_select(-2, indices)
            v = v.index_select(-2, indices)
        elif self.num_query_groups > 1:
            # (N, S_kv, H_kv, K_h) -> (N, S_kv, H, K_h)
            k = repeat_interleave(k, dim=-2, repeat=self.num_query_groups)
            v = repeat_interleave(v, dim=-2, repeat=self.num_query_groups)

        # (N, S, H, K_h)
        attns = run_sdpa(self.sdpa, q, seqs_layout, k, keys_layout, v, bias_cache)

        del q, k, v

        attns = attns * torch.sigmoid(gate)

        # (N, S, H, K_h) -> (N, S, M)
        return self.output_proj(attns.flatten(-2, -1))

    def _project_replicated_key_values(self, seqs: Tensor) -> tuple[Tensor, Tensor]:
        """Returns the key/value heads that the rank's query heads use, from
        the gathered ``k_proj`` and ``v_proj`` weights."""
        first_row = self.first_key_value_head * self.head_dim

        num_rows = (max(self.key_value_head_indices) + 1) * self.head_dim

        # Each rank's gradients cover only its query heads: both the input's
        # and the gathered weights' are summed, and each rank keeps the sum
        # of its rows.
        seqs = reduce_on_backward(seqs, self.tp_gang)

        def project(proj: ColumnShardedLinear) -> Tensor:
            weight = sum_gradient_over_tp(gather(proj.weight, self.tp_gang, dim=0), self.tp_gang)

            output = linear(seqs, weight.narrow(0, first_row, num_rows))

            # The projection's forward, and so its adapter's hook, does not
            # run: the adapter's rows are taken as the weight's are.
            adapter = getattr(proj, "lora", None)

            if isinstance(adapter, LoraAdapter):
                output = output + adapter.update_rows(seqs, first_row, num_rows).to(output.dtype)

            return output

        return project(self.k_proj), project(self.v_proj)

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
        s = (
            f"num_heads={self.num_heads}, "
            f"num_key_value_heads={self.num_key_value_heads}, "
            f"head_dim={self.head_dim}"
        )

        if self.tp_gang.size > 1 and not self.shard_key_value_heads:
            s = f"{s}, replicated_key_value_heads=True"

        return s
