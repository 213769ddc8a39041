"""How Qwen3.5 models are split over ranks and checkpointed in training: the
families' FSDP2 and activation-checkpointing appliers. The layers shard
themselves under tensor parallelism (:mod:`qwen35_fs2.nn.tp`)."""

from __future__ import annotations

from qwen35_fs2.parallel.ac import apply_ac_to_qwen35 as apply_ac_to_qwen35
from qwen35_fs2.parallel.fsdp import apply_fsdp_to_qwen35 as apply_fsdp_to_qwen35
from qwen35_fs2.parallel.fsdp import shard_qwen35_with_fsdp2 as shard_qwen35_with_fsdp2
