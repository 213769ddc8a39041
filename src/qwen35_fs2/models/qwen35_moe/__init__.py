"""The Qwen3.5-MoE family (``qwen35_moe``), which Qwen3-Next checkpoints load
into too."""

from __future__ import annotations

from qwen35_fs2.models.qwen35_moe.config import QWEN35_MOE_FAMILY as QWEN35_MOE_FAMILY
from qwen35_fs2.models.qwen35_moe.config import (
    Qwen35ExpertsConfig as Qwen35ExpertsConfig,
)
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig as Qwen35MoeConfig
from qwen35_fs2.models.qwen35_moe.config import (
    register_qwen35_moe_configs as register_qwen35_moe_configs,
)
from qwen35_fs2.models.qwen35_moe.config import (
    tiny_qwen35_moe_config as tiny_qwen35_moe_config,
)
from qwen35_fs2.models.qwen35_moe.factory import Qwen35MoeFactory as Qwen35MoeFactory
from qwen35_fs2.models.qwen35_moe.factory import (
    create_qwen35_moe_model as create_qwen35_moe_model,
)
from qwen35_fs2.models.qwen35_moe.hub import (
    get_qwen35_moe_model_hub as get_qwen35_moe_model_hub,
)
from qwen35_fs2.models.qwen35_moe.interop import (
    convert_qwen35_moe_state_dict as convert_qwen35_moe_state_dict,
)
from qwen35_fs2.models.qwen35_moe.sharder import (
    get_qwen35_moe_shard_specs as get_qwen35_moe_shard_specs,
)
