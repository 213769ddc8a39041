"""Loading Hugging Face Qwen3.5 directories as fairseq2 models."""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open

from fairseq2.data_type import DataType
from fairseq2.device import Device
from fairseq2.model_checkpoint import CorruptModelCheckpointError
from fairseq2.models.transformer_lm import TransformerLM

from qwen35_fs2.hf.config import drop_absent_mtp_head, load_hf_config, qwen35_config_from_hf
from qwen35_fs2.hf.safetensors import index_safetensors
from qwen35_fs2.models.qwen35.hub import get_qwen35_model_hub
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig
from qwen35_fs2.models.qwen35_moe.hub import get_qwen35_moe_model_hub


def check_safetensors_files(path: Path) -> None:
    """Opens every safetensors file of ``path`` (reading only its header), so
    a truncated or corrupt file is reported by name before any tensor is
    loaded; the safetensors library itself does not name the file."""
    files = sorted(path.glob("*.safetensors"))

    if not files:
        raise CorruptModelCheckpointError(
            path, f"{path} must contain safetensors checkpoint files, but has none."
        )

    for file in files:
        try:
            with safe_open(file, framework="pt"):
                pass
        except (SafetensorError, OSError) as ex:
            raise CorruptModelCheckpointError(
                path, f"{file} cannot be loaded as a Safetensors checkpoint file: {ex}"
            ) from ex


def load_hf_model(
    path: str | Path,
    *,
    device: Device | None = None,
    dtype: DataType | None = None,
) -> TransformerLM:
    """Loads a Hugging Face Qwen3.5 directory (``config.json`` and
    safetensors, released or text-only layout) through fairseq2's checkpoint
    loader. Qwen3.5-MoE and Qwen3-Next directories load as the ``qwen35_moe``
    family.

    :param device: The device of the model; the default device if ``None``.
    :param dtype: The dtype of the parameters; the default dtype if ``None``.
    """
    path = Path(path)

    config = qwen35_config_from_hf(load_hf_config(path))

    check_safetensors_files(path)

    config = drop_absent_mtp_head(config, index_safetensors(path).keys(), path)

    try:
        if isinstance(config, Qwen35MoeConfig):
            return get_qwen35_moe_model_hub().load_custom_model(
                path, config, device=device, dtype=dtype
            )

        return get_qwen35_model_hub().load_custom_model(
            path, config, device=device, dtype=dtype
        )
    except CorruptModelCheckpointError as ex:
        # fairseq2 keeps the details (which keys, which shapes) in the cause.
        cause = f" {ex.__cause__}" if ex.__cause__ is not None else ""

        raise CorruptModelCheckpointError(ex.path, f"{ex}{cause}") from ex
