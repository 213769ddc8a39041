"""The gated delta rule (Gated DeltaNet's token mixer)."""

from __future__ import annotations

from qwen35_fs2.ops.delta_rule.chunk import (
    chunk_gated_delta_rule as chunk_gated_delta_rule,
)
from qwen35_fs2.ops.delta_rule.dispatch import gated_delta_rule as gated_delta_rule
from qwen35_fs2.ops.delta_rule.recurrent import (
    recurrent_gated_delta_rule as recurrent_gated_delta_rule,
)
