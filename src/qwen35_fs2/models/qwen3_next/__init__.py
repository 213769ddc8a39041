"""Qwen3-Next checkpoints, imported into the ``qwen35_moe`` family."""

from __future__ import annotations

from qwen35_fs2.models.qwen3_next.interop import (
    is_qwen3_next_state_dict as is_qwen3_next_state_dict,
)
from qwen35_fs2.models.qwen3_next.interop import (
    unpack_qwen3_next_projections as unpack_qwen3_next_projections,
)
