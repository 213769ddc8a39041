"""Hugging Face checkpoints in and out: reading ``config.json`` files as our
configurations, loading checkpoints (whole, or straight into each rank's
shards) and exporting models as Hugging Face repositories."""

from __future__ import annotations

from qwen35_fs2.hf.config import load_hf_config as load_hf_config
from qwen35_fs2.hf.config import qwen35_config_from_hf as qwen35_config_from_hf
from qwen35_fs2.hf.export import HfExportError as HfExportError
from qwen35_fs2.hf.export import save_hf_model as save_hf_model
from qwen35_fs2.hf.loading import load_hf_model as load_hf_model
