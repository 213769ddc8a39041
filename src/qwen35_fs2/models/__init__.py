"""The Qwen3.5 model families."""

from __future__ import annotations

from qwen35_fs2.models.config import QWEN35_FAMILY as QWEN35_FAMILY
from qwen35_fs2.models.config import Qwen35Config as Qwen35Config
from qwen35_fs2.models.config import qwen35_config_from_hf as qwen35_config_from_hf
from qwen35_fs2.models.config import (
    register_qwen35_configs as register_qwen35_configs,
)
from qwen35_fs2.models.factory import Qwen35Factory as Qwen35Factory
from qwen35_fs2.models.factory import create_qwen35_model as create_qwen35_model
from qwen35_fs2.models.hf import load_hf_model as load_hf_model
from qwen35_fs2.models.hub import get_qwen35_model_hub as get_qwen35_model_hub
from qwen35_fs2.models.interop import (
    convert_qwen35_state_dict as convert_qwen35_state_dict,
)
