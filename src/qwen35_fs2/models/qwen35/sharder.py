"""The tensor-parallel split of Qwen3.5 models as a fairseq2 shard-spec table.

The Qwen3.5 modules shard themselves when ``gangs.tp.size > 1`` and report
their split through :meth:`~fairseq2.nn.Sharded.get_shard_dims`, which the
checkpoint loaders use to reshard. This table states the same split in the
format of fairseq2's (deprecated) ``ModelSharder``, for tools written against
it; it is not passed to ``register_model_family``.
"""

from __future__ import annotations

from typing import Final

from fairseq2.sharder import ShardSpec

from qwen35_fs2.models.qwen35.config import Qwen35Config

LAYER_PATTERN: Final = r"^(decoder|mtp)\.layers\.[0-9]+\."
"""The module paths of the decoder layers (the trunk's and the MTP head's),
as the patterns of the specs begin."""


def get_qwen35_shard_specs(config: Qwen35Config) -> dict[str, ShardSpec]:
    """Returns the modules that tensor parallelism shards, as regular
    expressions over module paths, with the dimension of their parameters
    that is split.

    Column-sharded projections split dimension 0 of their weight, row-sharded
    ones dimension 1; ``region_boundary`` marks those whose output (column)
    or input (row) stays sharded. ``linear_attn.decay`` splits its ``A_log``
    and ``dt_bias`` by value head. ``k_proj`` and ``v_proj`` are stored split by rows
    even where their heads are replicated for the computation (fewer
    key/value heads than ranks). The per-head norms are replicated.
    """
    column = ShardSpec(dim=0, region_boundary=True)

    row = ShardSpec(dim=1, region_boundary=True)

    specs = {
        # fmt: off
        r"^decoder_frontend\.embed$":                                   ShardSpec(dim=0),
        LAYER_PATTERN + r"self_attn\.(q_proj|k_proj|v_proj)$":          column,
        LAYER_PATTERN + r"self_attn\.output_proj$":                     row,
        LAYER_PATTERN + r"linear_attn\.decay$":                         ShardSpec(dim=0),
        LAYER_PATTERN + r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a)$": column,
        LAYER_PATTERN + r"linear_attn\.conv1d$":                        ShardSpec(dim=0),
        LAYER_PATTERN + r"linear_attn\.output_proj$":                   row,
        LAYER_PATTERN + r"ffn\.(gate_proj|inner_proj)$":                column,
        LAYER_PATTERN + r"ffn\.output_proj$":                           row,
        r"^final_proj$":                                                ShardSpec(dim=0),
        # fmt: on
    }

    return specs
