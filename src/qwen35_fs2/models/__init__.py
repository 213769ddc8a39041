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
from qwen35_fs2.models.hf_export import HfExportError as HfExportError
from qwen35_fs2.models.hf_export import save_hf_model as save_hf_model
from qwen35_fs2.models.hub import get_qwen35_model_hub as get_qwen35_model_hub
from qwen35_fs2.models.interop import (
    convert_qwen35_state_dict as convert_qwen35_state_dict,
)
from qwen35_fs2.models.moe_config import QWEN35_MOE_FAMILY as QWEN35_MOE_FAMILY
from qwen35_fs2.models.moe_config import Qwen35ExpertsConfig as Qwen35ExpertsConfig
from qwen35_fs2.models.moe_config import Qwen35MoeConfig as Qwen35MoeConfig
from qwen35_fs2.models.moe_config import (
    register_qwen35_moe_configs as register_qwen35_moe_configs,
)
from qwen35_fs2.models.moe_factory import Qwen35MoeFactory as Qwen35MoeFactory
from qwen35_fs2.models.moe_factory import (
    create_qwen35_moe_model as create_qwen35_moe_model,
)
from qwen35_fs2.models.moe_hub import (
    get_qwen35_moe_model_hub as get_qwen35_moe_model_hub,
)
from qwen35_fs2.models.moe_interop import (
    convert_qwen35_moe_state_dict as convert_qwen35_moe_state_dict,
)
