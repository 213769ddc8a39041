"""Typed access to the Qwen3.5 family through fairseq2's model hub."""

from __future__ import annotations

from fairseq2.models import ModelHubAccessor
from fairseq2.models.transformer_lm import TransformerLM

from qwen35_fs2.models.qwen35.config import QWEN35_FAMILY, Qwen35Config

get_qwen35_model_hub = ModelHubAccessor(
    QWEN35_FAMILY, kls=TransformerLM, config_kls=Qwen35Config
)
