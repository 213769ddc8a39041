"""Loading Hugging Face Qwen3.5 directories as fairseq2 models."""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError
from safetensors import SafetensorError, safe_open

from fairseq2.assets import AssetCard, AssetDownloadError
from fairseq2.data_type import DataType
from fairseq2.device import Device
from fairseq2.logging import log
from fairseq2.model_checkpoint import CorruptModelCheckpointError
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.utils.uri import Uri

from qwen35_fs2.models.config import qwen35_config_from_hf
from qwen35_fs2.models.hub import get_qwen35_model_hub
from qwen35_fs2.models.moe_config import Qwen35MoeConfig
from qwen35_fs2.models.moe_hub import get_qwen35_moe_model_hub


def load_hf_config(path: Path) -> dict[str, object]:
    """Reads ``config.json`` of a Hugging Face model directory."""
    config_file = path / "config.json"

    try:
        text = config_file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} must be a Hugging Face model directory with a config.json file, but has none."
        ) from None

    try:
        config = json.loads(text)
    except json.JSONDecodeError as ex:
        raise ValueError(f"{config_file} is not valid JSON: {ex}") from None

    if not isinstance(config, dict):
        raise ValueError(f"{config_file} must hold a JSON object.")

    return config


def find_checkpoint_hf_config(card: AssetCard) -> Path | None:
    """Returns the Hugging Face ``config.json`` of the checkpoint of
    ``card``, or ``None`` if it has none.

    A local checkpoint (a path or a ``file://`` URI, with the card's
    ``checkpoint_path`` if any) has it in its directory, or in the directory
    of its file. fairseq2 downloads only the safetensors of a Hugging Face Hub
    checkpoint (``hg://``), so the repository's ``config.json`` is downloaded
    here, into the Hub cache next to them. Where it cannot be had (other
    schemes, offline without a cached copy) a warning says so.
    """
    uri_field = card.maybe_get_field("checkpoint")

    # A gated model; fairseq2 refuses to load it.
    if uri_field is None:
        return None

    uri = uri_field.as_uri()

    sub_path_field = card.maybe_get_field("checkpoint_path")

    if uri.scheme == "file":
        path = uri.to_path()

        if sub_path_field is not None:
            path = path.joinpath(sub_path_field.as_(str))

        config_file = (path if path.is_dir() else path.parent) / "config.json"

        return config_file if config_file.is_file() else None

    if uri.scheme == "hg" and sub_path_field is None:
        return _download_hub_config(card, uri)

    log.warning(
        "The checkpoint of the {} asset card ({}) has no config.json that can be read: only local and whole-repository Hugging Face Hub checkpoints have one. The model's architecture, its tie flag included, comes from the card alone.",
        card.name,
        uri,
    )

    return None


def _download_hub_config(card: AssetCard, uri: Uri) -> Path | None:
    repo_id = str(uri).removeprefix("hg://")

    # Every rank asks (there is no gang here): the Hub only when the cache
    # has no copy yet.
    try:
        return Path(hf_hub_download(repo_id, "config.json", local_files_only=True))
    except LocalEntryNotFoundError:
        pass

    try:
        return Path(hf_hub_download(repo_id, "config.json"))
    except EntryNotFoundError as ex:
        # Not in the repository, or offline and not in the cache.
        log.warning(
            "The config.json of {} cannot be had ({}). The architecture of the {} asset card, its tie flag included, comes from the card alone.",
            uri,
            ex,
            card.name,
        )

        return None
    except HfHubHTTPError as ex:
        raise AssetDownloadError(uri, "Hugging Face Hub returned an error.") from ex


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
