"""Converts Hugging Face Qwen3.5 checkpoints to fairseq2 state dicts."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Final

import torch
from torch import Tensor

from fairseq2.error import StateDictError
from fairseq2.models.utils.checkpoint import (
    convert_state_dict,
    create_reverse_key_map,
)

from qwen35_fs2.models.qwen35.config import Qwen35Config

# Keys of the text-only layout (`Qwen3_5ForCausalLM`). The released layout
# (`Qwen3_5ForConditionalGeneration`) nests the same keys under
# `model.language_model.`; see `_VLM_PREFIX`.
_HG_KEY_MAP: Final = {
    # fmt: off
    r"^model\.embed_tokens\.":                               r"decoder_frontend.embed.",
    r"^model\.layers\.([0-9]+)\.input_layernorm\.":          r"decoder.layers.\1.self_attn_layer_norm.",
    r"^model\.layers\.([0-9]+)\.post_attention_layernorm\.": r"decoder.layers.\1.ffn_layer_norm.",
    r"^model\.layers\.([0-9]+)\.self_attn\.q_proj\.":        r"decoder.layers.\1.self_attn.q_proj.",
    r"^model\.layers\.([0-9]+)\.self_attn\.k_proj\.":        r"decoder.layers.\1.self_attn.k_proj.",
    r"^model\.layers\.([0-9]+)\.self_attn\.v_proj\.":        r"decoder.layers.\1.self_attn.v_proj.",
    r"^model\.layers\.([0-9]+)\.self_attn\.q_norm\.":        r"decoder.layers.\1.self_attn.q_norm.",
    r"^model\.layers\.([0-9]+)\.self_attn\.k_norm\.":        r"decoder.layers.\1.self_attn.k_norm.",
    r"^model\.layers\.([0-9]+)\.self_attn\.o_proj\.":        r"decoder.layers.\1.self_attn.output_proj.",
    r"^model\.layers\.([0-9]+)\.linear_attn\.in_proj_qkv\.": r"decoder.layers.\1.linear_attn.in_proj_qkv.",
    r"^model\.layers\.([0-9]+)\.linear_attn\.in_proj_z\.":   r"decoder.layers.\1.linear_attn.in_proj_z.",
    r"^model\.layers\.([0-9]+)\.linear_attn\.in_proj_b\.":   r"decoder.layers.\1.linear_attn.in_proj_b.",
    r"^model\.layers\.([0-9]+)\.linear_attn\.in_proj_a\.":   r"decoder.layers.\1.linear_attn.in_proj_a.",
    r"^model\.layers\.([0-9]+)\.linear_attn\.conv1d\.":      r"decoder.layers.\1.linear_attn.conv1d.",
    r"^model\.layers\.([0-9]+)\.linear_attn\.A_log$":        r"decoder.layers.\1.linear_attn.decay.A_log",
    r"^model\.layers\.([0-9]+)\.linear_attn\.dt_bias$":      r"decoder.layers.\1.linear_attn.decay.dt_bias",
    r"^model\.layers\.([0-9]+)\.linear_attn\.norm\.":        r"decoder.layers.\1.linear_attn.norm.",
    r"^model\.layers\.([0-9]+)\.linear_attn\.out_proj\.":    r"decoder.layers.\1.linear_attn.output_proj.",
    r"^model\.layers\.([0-9]+)\.mlp\.gate_proj\.":           r"decoder.layers.\1.ffn.gate_proj.",
    r"^model\.layers\.([0-9]+)\.mlp\.up_proj\.":             r"decoder.layers.\1.ffn.inner_proj.",
    r"^model\.layers\.([0-9]+)\.mlp\.down_proj\.":           r"decoder.layers.\1.ffn.output_proj.",
    r"^model\.norm\.":                                       r"decoder.layer_norm.",
    r"^lm_head\.":                                           r"final_proj.",
    # The MTP head; its decoder layers go through the trunk's entries (see
    # `mtp_layers_as_trunk_layers`).
    r"^mtp\.fc\.":                                           r"mtp.fc.",
    r"^mtp\.pre_fc_norm_embedding\.":                        r"mtp.pre_fc_norm_embedding.",
    r"^mtp\.pre_fc_norm_hidden\.":                           r"mtp.pre_fc_norm_hidden.",
    r"^mtp\.norm\.":                                         r"mtp.layer_norm.",
    # fmt: on
}

_VLM_PREFIX: Final = "model.language_model."

# The MTP head as some re-exports store it.
_VLM_MTP_PREFIX: Final = _VLM_PREFIX + "mtp."

# Tensors of the released checkpoints that a text model does not use: the
# vision tower.
_SKIPPED_KEY_PATTERNS: Final = (re.compile(r"^model\.visual\."),)

# Present in every Hugging Face checkpoint, never in a fairseq2 one.
_HG_SENTINEL_KEYS: Final = ("model.embed_tokens.weight", _VLM_PREFIX + "embed_tokens.weight")


def is_hg_state_dict(state_dict: Mapping[str, object]) -> bool:
    """Returns ``True`` if ``state_dict`` is in Hugging Face format (either
    layout) rather than a native fairseq2 checkpoint (shard)."""
    return any(key in state_dict for key in _HG_SENTINEL_KEYS)


def convert_qwen35_state_dict(
    state_dict: dict[str, object], config: Qwen35Config
) -> dict[str, object]:
    """Converts a Hugging Face Qwen3.5 state dict to fairseq2 keys.

    Native fairseq2 checkpoints (detected by the absence of the embedding's
    Hugging Face key) pass through unchanged, except for the duplicate
    ``final_proj.weight`` of tied models, so calling this on every shard of a
    fairseq2 checkpoint is safe. The vision tower is skipped, and so is the
    MTP head (``mtp.*`` or ``model.language_model.mtp.*``) if
    ``config.mtp_num_layers`` is 0; any other unknown key is an error, and so
    is an output
    projection that differs from the embedding table under tied embeddings
    (:func:`check_tied_output_weights`). Besides renaming, the rows of the
    Gated DeltaNet ``in_proj_qkv`` and ``conv1d`` weights are grouped by key
    head (:func:`group_qkv_rows`), a permutation.
    """
    check_tied_output_weights(state_dict, config)

    if not is_hg_state_dict(state_dict):
        if config.tied_embeddings and "final_proj.weight" in state_dict:
            # fairseq2 saves tied weights under both keys. Only the
            # embedding's key is a parameter name, and so only it reshards
            # across tensor parallel sizes; the model ties the other.
            return {k: v for k, v in state_dict.items() if k != "final_proj.weight"}

        return state_dict

    text_state_dict = mtp_layers_as_trunk_layers(strip_vlm_prefix(state_dict), config)

    with mtp_keys_in_errors(config):
        converted = convert_hg_text_state_dict(text_state_dict, config)

    return trunk_layers_as_mtp_layers(converted, config)


def convert_hg_text_state_dict(
    text_state_dict: dict[str, object], config: Qwen35Config
) -> dict[str, object]:
    """Converts the language-model tensors of a Hugging Face state dict in the
    text-only layout (:func:`strip_vlm_prefix`) whose output projection
    :func:`check_tied_output_weights` accepted; the part of
    :func:`convert_qwen35_state_dict` that the MoE converter shares."""
    unknown_keys = []

    for key in text_state_dict:
        if any(p.match(key) for p in _HG_KEY_MAP_PATTERNS):
            continue

        unknown_keys.append(key)

    if unknown_keys:
        raise StateDictError(
            f"The Hugging Face checkpoint has keys that are not part of a Qwen3.5 language model: {', '.join(sorted(unknown_keys))}"
        )

    if config.tied_embeddings:
        # Equal to the embedding table (checked), so nothing is lost.
        text_state_dict.pop(_HG_OUTPUT_KEY, None)

    converted = convert_state_dict(text_state_dict, _HG_KEY_MAP)

    for key, value in converted.items():
        if _GROUPED_QKV_KEY.match(key):
            converted[key] = group_qkv_rows(key, value, config)

    if config.tied_embeddings and "decoder_frontend.embed.weight" in converted:
        converted["final_proj.weight"] = converted["decoder_frontend.embed.weight"]

    return converted


_HG_OUTPUT_KEY: Final = "lm_head.weight"


def find_output_weight_keys(keys: Collection[str]) -> tuple[str, str] | None:
    """Returns the keys of the embedding table and of the output projection
    of a checkpoint with ``keys`` (Hugging Face, either layout, or fairseq2)
    if it has both, otherwise ``None``."""
    if _HG_OUTPUT_KEY in keys:
        for embed_key in _HG_SENTINEL_KEYS:
            if embed_key in keys:
                return embed_key, _HG_OUTPUT_KEY

    if "final_proj.weight" in keys and "decoder_frontend.embed.weight" in keys:
        return "decoder_frontend.embed.weight", "final_proj.weight"

    return None


def check_tied_output_weights(state_dict: Mapping[str, object], config: Qwen35Config) -> None:
    """Raises :func:`tied_output_weights_error` if ``config`` ties the output
    projection to the embedding table but ``state_dict`` holds an output
    projection that differs from its embedding table: tying would drop a
    trained head, so the tie flag of a preset or a ``config.json`` is never
    taken on trust.

    Meta tensors hold no values to compare; whoever converts them (the
    sharded loader, which validates a checkpoint on meta tensors) compares
    the data itself.
    """
    if not config.tied_embeddings:
        return

    keys = find_output_weight_keys(state_dict)

    if keys is None:
        return

    embed_key, output_key = keys

    embed, output = state_dict[embed_key], state_dict[output_key]

    if not isinstance(embed, Tensor) or not isinstance(output, Tensor):
        raise StateDictError(f"`{embed_key}` and `{output_key}` must be tensors, but are of types `{type(embed).__name__}` and `{type(output).__name__}` instead.")

    if embed.is_meta or output.is_meta:
        return

    if not torch.equal(embed, output):
        raise tied_output_weights_error(embed_key, output_key)


def tied_output_weights_error(embed_key: str, output_key: str) -> StateDictError:
    """The error of an output projection ``output_key`` that differs from the
    embedding table ``embed_key`` under tied embeddings."""
    return StateDictError(
        f"`{output_key}` must equal `{embed_key}` for a model with tied embeddings (`tied_embeddings: true`), but differs from it instead. "
        f"The checkpoint has a trained output projection of its own: to load it, set `tied_embeddings: false` in the model configuration (`tie_word_embeddings: false` in a Hugging Face config.json); "
        f"if the model is meant to be tied, remove `{output_key}` from the checkpoint."
    )


# The Gated DeltaNet tensors whose rows fairseq2 groups by key head.
_GROUPED_QKV_KEY: Final = re.compile(
    r"^decoder\.layers\.[0-9]+\.linear_attn\.(in_proj_qkv|conv1d)\.weight$"
)


def qkv_row_segments(config: Qwen35Config) -> list[tuple[int, int]]:
    """Returns, in the order of the fairseq2 rows of a Gated DeltaNet
    ``in_proj_qkv`` (and channels of its ``conv1d``), the ``(start, length)``
    row ranges of the Hugging Face tensor they are taken from.

    Hugging Face stores ``[q | k | v]``, each over all heads; fairseq2 stores
    ``[q_g | k_g | v_g]`` for each key head ``g`` and its value heads, so that
    tensor parallelism can split the rows in contiguous blocks (see
    :class:`~qwen35_fs2.nn.gated_deltanet.GatedDeltaNet`).
    """
    num_key_heads = config.num_linear_key_heads

    key_head_dim = config.linear_key_head_dim

    # The value rows of one key head's group.
    value_group_dim = config.num_linear_value_heads // num_key_heads * config.linear_value_head_dim

    key_dim = num_key_heads * key_head_dim

    segments = []

    for group_idx in range(num_key_heads):
        segments.append((group_idx * key_head_dim, key_head_dim))
        segments.append((key_dim + group_idx * key_head_dim, key_head_dim))
        segments.append((2 * key_dim + group_idx * value_group_dim, value_group_dim))

    return segments


def group_qkv_rows(key: str, value: object, config: Qwen35Config) -> Tensor:
    """Permutes the rows of a Hugging Face ``in_proj_qkv`` or ``conv1d``
    weight into the fairseq2 order of :func:`qkv_row_segments`."""
    segments = qkv_row_segments(config)

    weight = _check_qkv_rows(key, value, segments)

    return torch.cat([weight.narrow(0, start, length) for start, length in segments])


def ungroup_qkv_rows(key: str, value: object, config: Qwen35Config) -> Tensor:
    """Inverts :func:`group_qkv_rows`."""
    segments = qkv_row_segments(config)

    weight = _check_qkv_rows(key, value, segments)

    # (Hugging Face start, fairseq2 start, length) of every segment.
    placed = []

    offset = 0

    for start, length in segments:
        placed.append((start, offset, length))

        offset += length

    placed.sort()

    return torch.cat([weight.narrow(0, offset, length) for _, offset, length in placed])


def _check_qkv_rows(key: str, value: object, segments: list[tuple[int, int]]) -> Tensor:
    if not isinstance(value, Tensor):
        raise StateDictError(f"`{key}` must be a tensor, but is of type `{type(value).__name__}` instead.")

    num_rows = sum(length for _, length in segments)

    if value.ndim < 1 or value.size(0) != num_rows:
        raise StateDictError(
            f"`{key}` must have {num_rows} rows (2 × key dim + value dim), but has a shape of {tuple(value.shape)} instead."
        )

    return value


def strip_vlm_prefix(state_dict: Mapping[str, object]) -> dict[str, object]:
    """Returns the language-model tensors of ``state_dict`` in the text-only
    layout (the MTP head as ``mtp.*``), dropping the vision tower."""
    text_state_dict: dict[str, object] = {}

    for key, value in state_dict.items():
        if any(p.match(key) for p in _SKIPPED_KEY_PATTERNS):
            continue

        if key.startswith(_VLM_MTP_PREFIX):
            key = "mtp." + key[len(_VLM_MTP_PREFIX) :]
        elif key.startswith(_VLM_PREFIX):
            key = "model." + key[len(_VLM_PREFIX) :]

        if key in text_state_dict:
            raise StateDictError(
                f"The Hugging Face checkpoint has `{key}` in both the text-only and the vision-language layout."
            )

        text_state_dict[key] = value

    return text_state_dict


def has_mtp_tensors(keys: Collection[str]) -> bool:
    """Returns ``True`` if a Hugging Face checkpoint with ``keys`` (either
    layout) holds an MTP head."""
    return any(key.startswith(("mtp.", _VLM_MTP_PREFIX)) for key in keys)


_HG_LAYER_KEY: Final = re.compile(r"^model\.layers\.([0-9]+)\.")

_HG_MTP_LAYER_KEY: Final = re.compile(r"^mtp\.layers\.([0-9]+)\.")

_FS2_LAYER_KEY: Final = re.compile(r"^decoder\.layers\.([0-9]+)\.")

_FS2_MTP_LAYER_KEY: Final = re.compile(r"^mtp\.layers\.([0-9]+)\.")


def mtp_layers_as_trunk_layers(
    text_state_dict: Mapping[str, object], config: Qwen35Config
) -> dict[str, object]:
    """Returns ``text_state_dict`` (text-only layout) with the decoder layers
    of the MTP head renamed to trunk layers numbered after the trunk's
    (``mtp.layers.0.`` to ``model.layers.{num_layers}.``), as the factory
    builds them, so that the trunk's conversion (key map, MoE experts)
    converts them too; :func:`trunk_layers_as_mtp_layers` renames them back.
    Without an MTP head in ``config``, drops the checkpoint's.

    :raises StateDictError: if the checkpoint has trunk layers beyond
        ``config.num_layers``, which the renamed MTP layers would take the
        place of.
    """
    if config.mtp_num_layers == 0:
        return {k: v for k, v in text_state_dict.items() if not k.startswith("mtp.")}

    output: dict[str, object] = {}

    extra_keys = []

    for key, value in text_state_dict.items():
        if (match := _HG_LAYER_KEY.match(key)) and int(match[1]) >= config.num_layers:
            extra_keys.append(key)
        elif (match := _HG_MTP_LAYER_KEY.match(key)) and int(match[1]) < config.mtp_num_layers:
            key = f"model.layers.{config.num_layers + int(match[1])}.{key[match.end():]}"

        output[key] = value

    if extra_keys:
        raise StateDictError(
            f"The Hugging Face checkpoint has keys of layers beyond the {config.num_layers} of the model: {', '.join(sorted(extra_keys))}"
        )

    return output


def trunk_layers_as_mtp_layers(
    state_dict: Mapping[str, object], config: Qwen35Config
) -> dict[str, object]:
    """Renames the fairseq2 keys of the trunk layers beyond
    ``config.num_layers`` back to the MTP head's; see
    :func:`mtp_layers_as_trunk_layers`."""
    return _renumber_layers(state_dict, _FS2_LAYER_KEY, "mtp", -config.num_layers, config.num_layers)


@contextmanager
def mtp_keys_in_errors(config: Qwen35Config) -> Iterator[None]:
    """Names the MTP head's layers as the checkpoint does (``mtp.layers.0.``)
    in the :class:`StateDictError` of a conversion that took them as trunk
    layers (:func:`mtp_layers_as_trunk_layers`)."""
    try:
        yield
    except StateDictError as ex:
        def rename(match: re.Match[str]) -> str:
            layer_idx = int(match[1])

            if layer_idx < config.num_layers:
                return match[0]

            return f"mtp.layers.{layer_idx - config.num_layers}."

        raise StateDictError(_ANY_HG_LAYER_KEY.sub(rename, str(ex))) from None


_ANY_HG_LAYER_KEY: Final = re.compile(r"\bmodel\.layers\.([0-9]+)\.")


def _renumber_layers(
    state_dict: Mapping[str, object], pattern: re.Pattern[str], prefix: str, offset: int, first: int
) -> dict[str, object]:
    """Renames the keys of the layers that ``pattern`` matches from index
    ``first`` on to ``{prefix}.layers.{index + offset}.``."""
    output: dict[str, object] = {}

    for key, value in state_dict.items():
        if (match := pattern.match(key)) and int(match[1]) >= first:
            key = f"{prefix}.layers.{int(match[1]) + offset}.{key[match.end():]}"

        output[key] = value

    return output


_HG_KEY_MAP_PATTERNS: Final = tuple(re.compile(p) for p in _HG_KEY_MAP)

# `create_reverse_key_map` would copy a pattern's trailing `$` into the
# reversed replacement (`...A_log$`), so the end anchors are dropped before
# reversing. The two affected keys (`A_log`, `dt_bias`) are leaves, so the
# reversed prefix patterns cannot match anything else.
_HG_REVERSE_KEY_MAP: Final = create_reverse_key_map(
    {pattern.removesuffix("$"): repl for pattern, repl in _HG_KEY_MAP.items()}
)

_HG_REVERSE_KEY_MAP_PATTERNS: Final = tuple(re.compile(p) for p in _HG_REVERSE_KEY_MAP)


def convert_to_hg_state_dict(
    state_dict: Mapping[str, object], config: Qwen35Config
) -> dict[str, object]:
    """Converts a fairseq2 Qwen3.5 state dict to Hugging Face keys in the
    text-only layout (``model.*``, ``lm_head.*``); the inverse of
    :func:`convert_qwen35_state_dict`.

    Keys are renamed and the Gated DeltaNet ``in_proj_qkv``/``conv1d`` rows
    put back in Hugging Face order (:func:`ungroup_qkv_rows`); no value
    changes: norm weights are stored zero-centred on both sides. With tied
    embeddings ``lm_head.weight`` is left out, as Hugging Face saves it. Any
    key outside the table is an error. The MTP head comes out as ``mtp.*``.
    """
    state_dict = mtp_layers_as_fs2_trunk_layers(state_dict, config)

    unknown_keys = [
        key
        for key in state_dict
        if not any(p.match(key) for p in _HG_REVERSE_KEY_MAP_PATTERNS)
    ]

    if unknown_keys:
        raise StateDictError(
            f"The fairseq2 state dict has keys that have no Hugging Face Qwen3.5 counterpart: {', '.join(sorted(unknown_keys))}"
        )

    state_dict = {
        key: ungroup_qkv_rows(key, value, config) if _GROUPED_QKV_KEY.match(key) else value
        for key, value in state_dict.items()
    }

    converted = convert_state_dict(state_dict, _HG_REVERSE_KEY_MAP)

    if config.tied_embeddings:
        converted.pop("lm_head.weight", None)

    return hg_trunk_layers_as_mtp_layers(converted, config)


def mtp_layers_as_fs2_trunk_layers(
    state_dict: Mapping[str, object], config: Qwen35Config
) -> dict[str, object]:
    """The export's :func:`mtp_layers_as_trunk_layers`: renames the fairseq2
    keys of the MTP head's layers to trunk layers numbered after the
    trunk's."""
    return _renumber_layers(state_dict, _FS2_MTP_LAYER_KEY, "decoder", config.num_layers, 0)


def hg_trunk_layers_as_mtp_layers(
    hg_state_dict: Mapping[str, object], config: Qwen35Config
) -> dict[str, object]:
    """Inverts :func:`mtp_layers_as_fs2_trunk_layers` on Hugging Face keys."""
    return _renumber_layers(hg_state_dict, _HG_LAYER_KEY, "mtp", -config.num_layers, config.num_layers)
