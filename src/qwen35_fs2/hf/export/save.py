"""Saving a model object as a Hugging Face repository (the Python API), and
the :class:`~fairseq2.models.hg.HuggingFaceConverter` that fairseq2's own
export API gets for our families."""

from __future__ import annotations

from pathlib import Path
from typing import final

import torch
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from fairseq2.data_type import DataType
from fairseq2.models.hg import HuggingFaceConfig, HuggingFaceConverter

from qwen35_fs2.hf.config import qwen35_config_from_hf
from qwen35_fs2.hf.export.config import build_hf_config
from qwen35_fs2.hf.export.plan import plan_hf_export
from qwen35_fs2.hf.export.repository import EXPORT_DTYPES, HfExportError, HfRepository
from qwen35_fs2.hf.export.tensors import lay_out_experts, to_hg_state_dict
from qwen35_fs2.hf.export.writer import DEFAULT_MAX_SHARD_SIZE, write_hf_export
from qwen35_fs2.models.qwen35.config import Qwen35Config
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig

def save_hf_model(
    model: Module,
    out_dir: str | Path,
    *,
    config: Qwen35Config | None = None,
    base: str | Path | None = None,
    dtype: DataType | str | None = None,
    text_only: bool = False,
    force: bool = False,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    tokenizer_dir: str | Path | None = None,
    keep_base_mtp: bool = False,
) -> None:
    """Saves a Qwen3.5 model as a Hugging Face repository; the inverse of
    :func:`~qwen35_fs2.hf.loading.load_hf_model`.

    ``save_hf_model(load_hf_model(d), out, base=d)`` reproduces the tensors
    of ``d`` bit for bit.

    :param config: The model's configuration. If ``None``, read from ``base``.
    :param base: The Hugging Face directory the model was trained from; see
        :func:`plan_hf_export`. Without it the export is text-only.
    :param dtype: The dtype of the tensors, or its name (``"bfloat16"``);
        if ``None``, those of ``base``, else those of the model.
    :param text_only: If ``True``, leaves out the vision tower.
    :param force: If ``True``, replaces a non-empty ``out_dir``.
    :param max_shard_size: The largest safetensors shard in bytes.
    :param tokenizer_dir: Without ``base``, or with a base that holds no
        tokenizer, the Hugging Face tokenizer directory to ship with the
        model; see :func:`plan_hf_export`.
    :param keep_base_mtp: If ``True``, the MTP head is the base's instead of
        the model's; see :func:`plan_hf_export`.

    :raises HfExportError: if ``base`` does not match the model or the export
        cannot be written; ``out_dir`` is unchanged then.
    """
    if isinstance(dtype, str):
        if dtype not in EXPORT_DTYPES:
            raise ValueError(
                f"`dtype` must be one of {', '.join(EXPORT_DTYPES)}, but is '{dtype}' instead."
            )

        dtype = EXPORT_DTYPES[dtype]

    base_repo = None if base is None else HfRepository.open(base)

    if config is None:
        if base_repo is None:
            raise ValueError("`config` must be given when `base` is None, but is None.")

        try:
            config = qwen35_config_from_hf(base_repo.config)
        except ValueError as ex:
            raise HfExportError(f"The configuration of {base_repo.path} cannot be used: {ex}") from None

    state_dict = {k: v for k, v in model.state_dict().items() if isinstance(v, Tensor)}

    plan = plan_hf_export(
        state_dict,
        config,
        base=base_repo,
        dtype=dtype,
        text_only=text_only,
        tokenizer_dir=None if tokenizer_dir is None else Path(tokenizer_dir),
        keep_base_mtp=keep_base_mtp,
    )

    write_hf_export(plan, out_dir, force=force, max_shard_size=max_shard_size)


@final
class _Qwen35HuggingFaceConverter(HuggingFaceConverter):
    """Gives fairseq2's export API the text-only form of an export.

    fairseq2's own saver cannot write it with transformers 4.57 (no Qwen3.5
    config class); our recipes export their checkpoints during training with
    :class:`~qwen35_fs2.hf.export.training.HfCheckpointExporter` instead.
    """

    @override
    def to_hg_config(self, config: object) -> HuggingFaceConfig:
        if not isinstance(config, Qwen35Config):
            raise TypeError(
                f"`config` must be of type `{Qwen35Config}`, but is of type `{type(config)}` instead."
            )

        doc = build_hf_config(
            config, base=None, text_only=True, dtype=torch.float32, num_mtp_layers=0
        )

        arch = doc.pop("architectures")

        doc.pop("dtype")

        if isinstance(config, Qwen35MoeConfig):
            kls_name = "Qwen3_5MoeTextConfig"
        else:
            kls_name = "Qwen3_5TextConfig"

        return HuggingFaceConfig(doc, kls_name, arch)  # type: ignore[arg-type]

    @override
    def to_hg_state_dict(
        self, state_dict: dict[str, object], config: object
    ) -> dict[str, object]:
        if not isinstance(config, Qwen35Config):
            raise TypeError(
                f"`config` must be of type `{Qwen35Config}`, but is of type `{type(config)}` instead."
            )

        return lay_out_experts(to_hg_state_dict(state_dict, config), "per_expert")
