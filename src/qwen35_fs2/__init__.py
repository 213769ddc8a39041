"""Qwen3.5 for fairseq2.

The public Python API; the fairseq2 integration itself (model families,
archs, asset cards, tokenizer) is registered through the
``fairseq2.extension`` entry point
(:func:`qwen35_fs2.extension.register_qwen35`). The API's names are imported
when first used (:mod:`qwen35_fs2._exports`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qwen35_fs2._exports import lazy_exports

if TYPE_CHECKING:
    from qwen35_fs2.hf import load_hf_model as load_hf_model
    from qwen35_fs2.hf import qwen35_config_from_hf as qwen35_config_from_hf
    from qwen35_fs2.hf import save_hf_model as save_hf_model
    from qwen35_fs2.models.qwen35 import Qwen35Config as Qwen35Config
    from qwen35_fs2.models.qwen35_moe import Qwen35MoeConfig as Qwen35MoeConfig

__getattr__ = lazy_exports(
    __name__,
    {
        "hf": ("load_hf_model", "qwen35_config_from_hf", "save_hf_model"),
        "models.qwen35": ("Qwen35Config",),
        "models.qwen35_moe": ("Qwen35MoeConfig",),
    },
)
