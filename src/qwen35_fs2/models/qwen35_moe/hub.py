"""Typed access to the Qwen3.5-MoE family through fairseq2's model hub."""

from __future__ import annotations

from fairseq2.models import ModelHubAccessor
from fairseq2.models.transformer_lm import TransformerLM

from qwen35_fs2.models.qwen35_moe.config import QWEN35_MOE_FAMILY, Qwen35MoeConfig

get_qwen35_moe_model_hub = ModelHubAccessor(
    QWEN35_MOE_FAMILY, kls=TransformerLM, config_kls=Qwen35MoeConfig
)
