"""The tensor-parallel split of Qwen3.5-MoE models as a fairseq2 shard-spec
table; see :mod:`qwen35_fs2.models.qwen35.sharder`."""

from __future__ import annotations

from fairseq2.sharder import ShardSpec

from qwen35_fs2.models.qwen35.sharder import LAYER_PATTERN, get_qwen35_shard_specs
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig


def get_qwen35_moe_shard_specs(config: Qwen35MoeConfig) -> dict[str, ShardSpec]:
    """Returns the shard specs of the dense family and those of the MoE
    blocks: ``ffn.experts`` splits its stacked weights by expert, the shared
    expert is column/row sharded like a dense feed-forward network, and the
    router and the shared expert gate are replicated."""
    specs = get_qwen35_shard_specs(config)

    specs[LAYER_PATTERN + r"ffn\.experts$"] = ShardSpec(dim=0)
    specs[LAYER_PATTERN + r"ffn\.shared_expert\.(gate_proj|inner_proj)$"] = ShardSpec(dim=0, region_boundary=True)
    specs[LAYER_PATTERN + r"ffn\.shared_expert\.output_proj$"] = ShardSpec(dim=1, region_boundary=True)

    return specs
