"""The dense Qwen3.5 family (``qwen35``) and the ``qwen35`` tokenizer
family."""

from __future__ import annotations

from qwen35_fs2.models.qwen35.config import QWEN35_FAMILY as QWEN35_FAMILY
from qwen35_fs2.models.qwen35.config import Qwen35Config as Qwen35Config
from qwen35_fs2.models.qwen35.config import (
    register_qwen35_configs as register_qwen35_configs,
)
from qwen35_fs2.models.qwen35.config import tiny_qwen35_config as tiny_qwen35_config
from qwen35_fs2.models.qwen35.factory import Qwen35Factory as Qwen35Factory
from qwen35_fs2.models.qwen35.factory import create_qwen35_model as create_qwen35_model
from qwen35_fs2.models.qwen35.hub import get_qwen35_model_hub as get_qwen35_model_hub
from qwen35_fs2.models.qwen35.interop import (
    convert_qwen35_state_dict as convert_qwen35_state_dict,
)
from qwen35_fs2.models.qwen35.sharder import (
    get_qwen35_shard_specs as get_qwen35_shard_specs,
)
from qwen35_fs2.models.qwen35.tokenizer import (
    QWEN35_TOKENIZER_ASSET as QWEN35_TOKENIZER_ASSET,
)
from qwen35_fs2.models.qwen35.tokenizer import Qwen35Tokenizer as Qwen35Tokenizer
from qwen35_fs2.models.qwen35.tokenizer import (
    Qwen35TokenizerConfig as Qwen35TokenizerConfig,
)
from qwen35_fs2.models.qwen35.tokenizer import (
    load_qwen35_tokenizer as load_qwen35_tokenizer,
)
