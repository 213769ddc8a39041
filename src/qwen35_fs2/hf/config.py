"""Hugging Face ``config.json`` files as configurations of the Qwen3.5
families: reading them (the released vision-language and the text-only
layouts of Qwen3.5 and Qwen3.5-MoE, and Qwen3-Next), finding the one of an
asset card's checkpoint, and taking its architecture over into a card's
configuration.

The dense and the MoE configurations are both read here, so that neither
family's configuration module imports the other's.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Collection, Mapping
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Final, TypeVar

from huggingface_hub import get_safetensors_metadata, hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    NotASafetensorsRepoError,
    SafetensorsParsingError,
)

from fairseq2.assets import AssetCard, AssetCardError, AssetDownloadError
from fairseq2.logging import log
from fairseq2.utils.uri import Uri

from qwen35_fs2.hf.safetensors import SAFETENSORS_INDEX_FILE, index_safetensors, read_safetensors_weight_map
from qwen35_fs2.models.qwen35.config import ENDOFTEXT_IDX, Qwen35Config, check_config
from qwen35_fs2.models.qwen35.interop import has_mtp_tensors
from qwen35_fs2.models.qwen35_moe.config import (
    QWEN3_NEXT_ENDOFTEXT_IDX,
    Qwen35ExpertsConfig,
    Qwen35MoeConfig,
)


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


VISION_PROCESSOR_FILES: Final = (
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)
"""The files of a vision-language repository from which transformers'
``AutoProcessor`` builds its image and video processors, and which vLLM
reads at start-up for ``Qwen3_5(Moe)ForConditionalGeneration``."""


def _download_hub_config(card: AssetCard, uri: Uri) -> Path | None:
    repo_id = str(uri).removeprefix("hg://")

    # Every rank asks (there is no gang here): the Hub only when the cache
    # has no copy yet.
    try:
        return Path(hf_hub_download(repo_id, "config.json", local_files_only=True))
    except LocalEntryNotFoundError:
        pass

    try:
        config_file = Path(hf_hub_download(repo_id, "config.json"))
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

    # Downloaded just now, so the Hub answers: a run from the cache makes no
    # request (a node without network retries each for half a minute).
    _download_hub_processor_files(repo_id, config_file)

    return config_file


def _download_hub_processor_files(repo_id: str, config_file: Path) -> None:
    """Downloads the :data:`VISION_PROCESSOR_FILES` that the repository
    ``repo_id`` has, if its ``config_file`` is a vision-language one, into
    the Hub cache beside it: fairseq2 downloads the safetensors alone, and an
    export of a model trained from it is a vision-language repository too,
    which transformers and vLLM load only with them (the export copies them
    from there, and warns where they are missing)."""
    try:
        is_vlm = "vision_config" in load_hf_config(config_file.parent)
    except ValueError:
        # Reported, naming the card, when the configuration is read.
        return

    if not is_vlm:
        return

    for filename in VISION_PROCESSOR_FILES:
        try:
            hf_hub_download(repo_id, filename)
        except EntryNotFoundError:
            # Each repository has some of them.
            pass
        except HfHubHTTPError as ex:
            log.warning("The {} of hg://{} cannot be downloaded ({}); an export of a model trained from it will lack it.", filename, repo_id, ex)  # fmt: skip


def find_checkpoint_tensor_names(card: AssetCard, checkpoint_dir: Path) -> Collection[str] | None:
    """Returns the names of the tensors of the checkpoint of ``card``, whose
    ``config.json`` :func:`find_checkpoint_hf_config` found in
    ``checkpoint_dir``, or ``None`` where they cannot be had yet.

    A local checkpoint has them in the headers of its safetensors files. A
    Hugging Face Hub checkpoint (``hg://``) is downloaded by fairseq2 only
    after the configuration is made, so on its first run the cache holds the
    ``config.json`` alone; the names then come from the Hub (the index of a
    sharded checkpoint, or the header of a single file: kilobytes, which
    ``huggingface_hub`` reads without the tensors), so
    that the first run makes the configuration the later ones make from the
    cache. A cached index wins over the cached files, which an interrupted
    download leaves incomplete.
    """
    uri = card.field("checkpoint").as_uri()

    repo_id = str(uri).removeprefix("hg://") if uri.scheme == "hg" else None

    if repo_id is not None:
        cached_index = try_to_load_from_cache(repo_id, SAFETENSORS_INDEX_FILE)

        if isinstance(cached_index, str):
            return _read_index_tensor_names(card, Path(cached_index))

    if any(checkpoint_dir.glob("*.safetensors")):
        return index_safetensors(checkpoint_dir).keys()

    if repo_id is None:
        return None

    # The index into the Hub cache, as config.json (once for all ranks on a
    # shared cache); a checkpoint of one file has none, and huggingface_hub
    # reads that file's header alone.
    try:
        try:
            return _read_index_tensor_names(card, Path(hf_hub_download(repo_id, SAFETENSORS_INDEX_FILE)))
        except EntryNotFoundError as ex:
            if isinstance(ex, LocalEntryNotFoundError):
                raise

        return get_safetensors_metadata(repo_id).weight_map.keys()
    # Offline, unreachable (the Hub's errors are `OSError`s) or no safetensors.
    except (OSError, NotASafetensorsRepoError, SafetensorsParsingError) as ex:
        log.warning(
            "The tensor names of {} cannot be had before fairseq2 downloads it ({}): a config.json that counts an MTP head which the checkpoint lacks (as transformers' `save_pretrained` leaves it) then makes the load fail.",
            uri,
            ex,
        )

        return None


def _read_index_tensor_names(card: AssetCard, index_file: Path) -> Collection[str]:
    try:
        return read_safetensors_weight_map(index_file).keys()
    except ValueError:
        raise AssetCardError(card.name, f"{index_file}, the safetensors index of the checkpoint of the {card.name} asset card, must be a JSON object with a `weight_map` object, but is not.") from None  # fmt: skip


_SUPPORTED_TEXT_MODEL_TYPES: Final = ("qwen3_5_text",)

MOE_MODEL_TYPES: Final = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
"""The Hugging Face model types that :func:`qwen35_config_from_hf` reads as
a :class:`~qwen35_fs2.models.qwen35_moe.config.Qwen35MoeConfig`."""


def get_text_config(hg_config: Mapping[str, object]) -> Mapping[str, object]:
    """Returns the language-model part of a Hugging Face Qwen3.5 config.

    Released checkpoints nest it under ``text_config``; text-only checkpoints
    (``Qwen3_5ForCausalLM``) are flat.
    """
    text_config = hg_config.get("text_config")

    if text_config is None:
        return hg_config

    if not isinstance(text_config, Mapping):
        raise ValueError(
            f"`text_config` of the Hugging Face configuration must be a mapping, but is of type `{type(text_config).__name__}` instead."
        )

    return text_config


def qwen35_config_from_hf(hg_config: Mapping[str, object]) -> Qwen35Config:
    """Builds a :class:`Qwen35Config` from a Hugging Face ``config.json``.

    Accepts the released vision-language layout (``model_type: qwen3_5`` with
    a nested ``text_config``) and the text-only layout
    (``model_type: qwen3_5_text``). Settings this package does not implement
    (biases, another activation, RoPE scaling) raise a :class:`ValueError`.

    MoE configurations (:data:`MOE_MODEL_TYPES`) give a
    :class:`~qwen35_fs2.models.qwen35_moe.config.Qwen35MoeConfig`.
    """
    model_type = hg_config.get("model_type")

    if model_type in MOE_MODEL_TYPES:
        return qwen35_moe_config_from_hf(hg_config)

    if model_type not in ("qwen3_5", "qwen3_5_text"):
        raise ValueError(
            f"The Hugging Face configuration must have `model_type` 'qwen3_5' or 'qwen3_5_text', but has '{model_type}' instead. The MoE model types {MOE_MODEL_TYPES} are read too."
        )

    text = get_text_config(hg_config)

    text_model_type = text.get("model_type", "qwen3_5_text")

    if text_model_type not in _SUPPORTED_TEXT_MODEL_TYPES:
        raise ValueError(
            f"`text_config.model_type` must be one of {_SUPPORTED_TEXT_MODEL_TYPES}, but is '{text_model_type}' instead."
        )

    reader = _HgConfigReader(text)

    config = Qwen35Config(
        **read_hf_text_fields(hg_config, text),
        ffn_inner_dim=reader.get_int("intermediate_size"),
    )

    check_config(config)

    return config


_OWN_SETTINGS: Final = (
    "gdn_backend",
    "full_attention_interval",
    "experts.dispatch",
    "experts.router_precision",
)
"""The fields of :class:`Qwen35Config` and
:class:`~qwen35_fs2.models.qwen35_moe.config.Qwen35MoeConfig` that a Hugging Face
config does not define: settings of this package, and the interval that
only derives ``layer_types`` (which Hugging Face configs list)."""

ConfigT = TypeVar("ConfigT", bound=Qwen35Config)


def adopt_hf_architecture(config: ConfigT, hf_config: Qwen35Config) -> tuple[ConfigT, list[str]]:
    """Returns a copy of ``config`` with every field that a Hugging Face
    config defines taken from ``hf_config`` (read by
    :func:`qwen35_config_from_hf`), and a line ``"`name` old -> new"`` for
    every field that changed. The fields of :data:`_OWN_SETTINGS` keep the
    values of ``config``; ``layer_types`` counts as changed only if the
    layers' mixers change.
    """
    if type(hf_config) is not type(config):
        raise TypeError(
            f"`hf_config` must be of type `{type(config).__name__}`, but is of type `{type(hf_config).__name__}` instead."
        )

    adopted = copy.deepcopy(config)

    changes: list[str] = []

    def adopt(target: object, source: object, prefix: str) -> None:
        for field in fields(source):  # type: ignore[arg-type]
            name = prefix + field.name

            if name in _OWN_SETTINGS:
                continue

            value = getattr(source, field.name)
            current = getattr(target, field.name)

            if is_dataclass(value):
                adopt(current, value, name + ".")
            elif name == "layer_types":
                if adopted.get_layer_types() != hf_config.get_layer_types():
                    changes.append(f"`{name}` {adopted.get_layer_types()} -> {value}")

                    setattr(target, field.name, copy.deepcopy(value))
            elif value != current:
                changes.append(f"`{name}` {current!r} -> {value!r}")

                setattr(target, field.name, copy.deepcopy(value))

    adopt(adopted, hf_config, "")

    return adopted, changes


def drop_absent_mtp_head(config: ConfigT, keys: Collection[str], checkpoint: Path) -> ConfigT:
    """Returns ``config`` without its MTP head (``mtp_num_layers`` 0) if the
    Hugging Face checkpoint ``checkpoint`` with tensors ``keys`` has none,
    saying so in the log; otherwise ``config``.

    transformers' ``save_pretrained`` drops the ``mtp.*`` tensors but keeps
    ``mtp_num_hidden_layers`` in the config, and such a checkpoint must load
    as what it is: a model without the head, never one with a random head.
    """
    if config.mtp_num_layers == 0 or has_mtp_tensors(keys):
        return config

    log.info(
        "{} has no MTP head (no `mtp.*` tensors) although its config.json says `mtp_num_hidden_layers: {}`, as transformers' `save_pretrained` leaves it; the model is loaded without the head (`mtp_num_layers: 0`).",
        checkpoint,
        config.mtp_num_layers,
    )

    return replace(config, mtp_num_layers=0)


def read_hf_text_fields(
    hg_config: Mapping[str, object], text: Mapping[str, object]
) -> dict[str, Any]:
    """Reads the :class:`Qwen35Config` fields that the dense and the MoE
    families share (all but ``ffn_inner_dim``) from a Hugging Face config and
    its language-model part ``text``."""
    reader = _HgConfigReader(text)

    reader.require_value("hidden_act", "silu", default="silu")
    reader.require_value("attention_bias", False, default=False)

    num_layers = reader.get_int("num_hidden_layers")

    layer_types = text.get("layer_types")

    if layer_types is None:
        interval = reader.get_int("full_attention_interval", default=4)

        layer_types = [
            "full_attention" if (idx + 1) % interval == 0 else "linear_attention"
            for idx in range(num_layers)
        ]

    rope_theta, partial_rotary_factor = _read_rope_parameters(text)

    # The nested layout ties through the top-level flag.
    tied = hg_config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))

    if not isinstance(tied, bool):
        raise ValueError(
            f"`tie_word_embeddings` must be a boolean, but is {tied!r} instead."
        )

    vocab_size = reader.get_int("vocab_size")

    pad_idx = text.get("pad_token_id", hg_config.get("pad_token_id"))

    if pad_idx is None and vocab_size > ENDOFTEXT_IDX:
        pad_idx = ENDOFTEXT_IDX

    if pad_idx is not None and not isinstance(pad_idx, int):
        raise ValueError(f"`pad_token_id` must be an integer, but is {pad_idx!r} instead.")

    model_dim = reader.get_int("hidden_size")
    num_attn_heads = reader.get_int("num_attention_heads")

    return dict(
        model_dim=model_dim,
        max_seq_len=reader.get_int("max_position_embeddings"),
        vocab_size=vocab_size,
        pad_idx=pad_idx,
        tied_embeddings=tied,
        num_layers=num_layers,
        layer_types=list(layer_types),  # type: ignore[arg-type]
        num_attn_heads=num_attn_heads,
        num_key_value_heads=reader.get_int("num_key_value_heads"),
        head_dim=reader.get_int("head_dim", default=model_dim // num_attn_heads),
        partial_rotary_factor=partial_rotary_factor,
        rope_theta=rope_theta,
        num_linear_key_heads=reader.get_int("linear_num_key_heads"),
        num_linear_value_heads=reader.get_int("linear_num_value_heads"),
        linear_key_head_dim=reader.get_int("linear_key_head_dim"),
        linear_value_head_dim=reader.get_int("linear_value_head_dim"),
        linear_conv_kernel_size=reader.get_int("linear_conv_kernel_dim"),
        rms_norm_eps=reader.get_float("rms_norm_eps", default=1e-6),
        init_std=reader.get_float("initializer_range", default=0.02),
        mtp_num_layers=reader.get_int("mtp_num_hidden_layers", default=0),
    )


def _read_rope_parameters(text: Mapping[str, object]) -> tuple[float, float]:
    """Returns ``(rope_theta, partial_rotary_factor)``.

    transformers 5 nests them in ``rope_parameters``; older files keep them
    at the top level of the text config. A ``rope_scaling`` entry replaces
    ``rope_parameters`` whole, as transformers 5.24 reads it (a YaRN block
    added to a released config is YaRN there, with that block's theta).
    """
    key = "rope_scaling" if text.get("rope_scaling") else "rope_parameters"

    rope = text.get(key) or {}

    if not isinstance(rope, Mapping):
        raise ValueError(
            f"`{key}` must be a mapping, but is of type `{type(rope).__name__}` instead."
        )

    # transformers' per-layer-type form (`{"full_attention": {...}}`), which
    # Qwen3.5's rotary embedding does not read: its theta would be missed.
    nested = [name for name, value in rope.items() if isinstance(value, Mapping)]

    if nested:
        raise ValueError(
            f"`{key}` must hold the RoPE parameters of the attention layers, but holds mappings under {', '.join(f'`{name}`' for name in nested)} instead (parameters per layer type are not supported)."
        )

    rope_type = rope.get("rope_type", rope.get("type", "default"))

    if rope_type != "default":
        raise ValueError(
            f"Only the 'default' RoPE type is supported, but `{key}.rope_type` is '{rope_type}'."
        )

    merged: dict[str, object] = {**text, **rope}

    reader = _HgConfigReader(merged)

    return (
        reader.get_float("rope_theta", default=10_000.0),
        reader.get_float("partial_rotary_factor", default=0.25),
    )


_MISSING: Final = object()


class _HgConfigReader:
    """Reads typed values from a Hugging Face config, naming bad keys."""

    def __init__(self, data: Mapping[str, object]) -> None:
        self._data = data

    def _get(self, key: str, default: object) -> object:
        value = self._data.get(key, default)

        if value is _MISSING:
            raise ValueError(
                f"The Hugging Face configuration must have a `{key}` entry, but has none."
            )

        return value

    def get_int(self, key: str, default: object = _MISSING) -> int:
        value = self._get(key, default)

        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"`{key}` must be an integer, but is {value!r} instead.")

        return value

    def get_float(self, key: str, default: object = _MISSING) -> float:
        value = self._get(key, default)

        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"`{key}` must be a number, but is {value!r} instead.")

        return float(value)

    def require_value(self, key: str, expected: object, *, default: object) -> None:
        value = self._get(key, default)

        if value != expected:
            raise ValueError(
                f"`{key}` must be {expected!r} (the only setting this package implements), but is {value!r} instead."
            )


def qwen35_moe_config_from_hf(hg_config: Mapping[str, object]) -> Qwen35MoeConfig:
    """Builds a :class:`Qwen35MoeConfig` from a Hugging Face ``config.json``.

    Accepts Qwen3.5-MoE in the released vision-language layout
    (``model_type: qwen3_5_moe`` with a nested ``text_config``) and the
    text-only layout (``qwen3_5_moe_text``), and Qwen3-Next
    (``qwen3_next``). Settings this package does not implement raise a
    :class:`ValueError`.
    """
    model_type = hg_config.get("model_type")

    if model_type not in MOE_MODEL_TYPES:
        raise ValueError(
            f"The Hugging Face configuration must have one of the `model_type`s {MOE_MODEL_TYPES}, but has '{model_type}' instead."
        )

    if model_type == "qwen3_next":
        text = hg_config
    else:
        text = get_text_config(hg_config)

        text_model_type = text.get("model_type", "qwen3_5_moe_text")

        if text_model_type != "qwen3_5_moe_text":
            raise ValueError(
                f"`text_config.model_type` must be 'qwen3_5_moe_text', but is '{text_model_type}' instead."
            )

    reader = _HgConfigReader(text)

    fields = read_hf_text_fields(hg_config, text)

    num_layers = fields["num_layers"]

    if model_type == "qwen3_next":
        # Qwen3-Next may interleave dense layers, and may skip renormalising.
        if fields["pad_idx"] is None and fields["vocab_size"] > QWEN3_NEXT_ENDOFTEXT_IDX:
            fields["pad_idx"] = QWEN3_NEXT_ENDOFTEXT_IDX

        sparse_step = reader.get_int("decoder_sparse_step", default=1)

        mlp_only_layers = text.get("mlp_only_layers") or []

        if not isinstance(mlp_only_layers, list):
            raise ValueError(
                f"`mlp_only_layers` must be a list of layer indices, but is {mlp_only_layers!r} instead."
            )

        dense_layers = [
            idx
            for idx in range(num_layers)
            if idx in mlp_only_layers or (idx + 1) % sparse_step != 0
        ]

        normalize_top_k = text.get("norm_topk_prob", True)

        if not isinstance(normalize_top_k, bool):
            raise ValueError(
                f"`norm_topk_prob` must be a boolean, but is {normalize_top_k!r} instead."
            )

        ffn_inner_dim = reader.get_int("intermediate_size")
    else:
        # transformers' Qwen3.5-MoE has an MoE block in every layer and always
        # renormalises; its config has no dense width.
        dense_layers = []

        normalize_top_k = True

        ffn_inner_dim = Qwen35MoeConfig().ffn_inner_dim

    experts = Qwen35ExpertsConfig(
        num_experts=reader.get_int("num_experts"),
        top_k=reader.get_int("num_experts_per_tok"),
        inner_dim=reader.get_int("moe_intermediate_size"),
        shared_expert_inner_dim=reader.get_int("shared_expert_intermediate_size"),
        normalize_top_k=normalize_top_k,
        dense_layers=dense_layers,
    )

    config = Qwen35MoeConfig(**fields, ffn_inner_dim=ffn_inner_dim, experts=experts)

    check_config(config)

    return config
