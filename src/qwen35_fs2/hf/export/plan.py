"""Planning an export: the ``config.json``, the tensors (the model's, and
what is carried over from the base) and the files of the repository to
write, checked against the base before anything is written."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, final

import torch
from torch import Tensor

from fairseq2.data_type import DataType
from fairseq2.logging import log

from qwen35_fs2.hf.config import VISION_PROCESSOR_FILES, qwen35_config_from_hf
from qwen35_fs2.hf.export.config import build_hf_config
from qwen35_fs2.hf.export.repository import EXPORT_DTYPES, VLM_TEXT_PREFIX, HfExportError, HfRepository, numel
from qwen35_fs2.hf.export.tensors import lay_out_experts, to_hg_state_dict
from qwen35_fs2.hf.safetensors import SafetensorsTensor
from qwen35_fs2.models.qwen35.config import Qwen35Config
from qwen35_fs2.models.qwen35_moe.config import Qwen35MoeConfig
from qwen35_fs2.nn.lora import is_lora_key

_VISUAL_KEY: Final = re.compile(r"^model\.visual\.")

# The MTP head, in either layout of a base.
_MTP_KEY: Final = re.compile(r"^(model\.language_model\.)?mtp\.")

_MTP_LAYER_KEY: Final = re.compile(r"^(?:model\.language_model\.)?mtp\.layers\.([0-9]+)\.")

_VLM_MTP_PREFIX: Final = VLM_TEXT_PREFIX + "mtp."

# Files of a base repository that an export carries over: generation
# defaults, tokenizer, chat template and licence. The processor configs
# belong to the vision tower and are left out of text-only exports. The model
# card (README.md) describes the base model, not the fine-tuned one.
_COPIED_FILES: Final = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "LICENSE",
    "LICENSE.txt",
    "NOTICE",
)

# The fields of `Qwen35Config` that decide tensor shapes and the layer
# structure, with their Hugging Face names; a base must agree on all of them.
_ARCHITECTURE_FIELDS: Final = (
    ("model_dim", "hidden_size"),
    ("vocab_size", "vocab_size"),
    ("tied_embeddings", "tie_word_embeddings"),
    ("num_layers", "num_hidden_layers"),
    ("num_attn_heads", "num_attention_heads"),
    ("num_key_value_heads", "num_key_value_heads"),
    ("head_dim", "head_dim"),
    ("num_linear_key_heads", "linear_num_key_heads"),
    ("num_linear_value_heads", "linear_num_value_heads"),
    ("linear_key_head_dim", "linear_key_head_dim"),
    ("linear_value_head_dim", "linear_value_head_dim"),
    ("linear_conv_kernel_size", "linear_conv_kernel_dim"),
    ("ffn_inner_dim", "intermediate_size"),
)

_MOE_ARCHITECTURE_FIELDS: Final = (
    ("num_experts", "num_experts"),
    ("top_k", "num_experts_per_tok"),
    ("inner_dim", "moe_intermediate_size"),
    ("shared_expert_inner_dim", "shared_expert_intermediate_size"),
)


@final
@dataclass(frozen=True)
class _PlannedTensor:
    """A tensor of the export: taken from the model or copied from the base."""

    source: Tensor | SafetensorsTensor
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return numel(self.shape) * self.dtype.itemsize


@final
@dataclass(frozen=True)
class HfExportPlan:
    """Everything an export writes, before any of it is written."""

    config: dict[str, object]
    """The ``config.json`` document."""

    tensors: dict[str, _PlannedTensor]

    copied_files: list[Path]
    """Files of the base repository (or tokenizer directory) that are copied
    as they are."""

    base: HfRepository | None

    generation_config: dict[str, object] | None = None
    """The ``generation_config.json`` document of an export that has no base
    to copy it from."""


def plan_hf_export(
    state_dict: Mapping[str, Tensor],
    config: Qwen35Config,
    *,
    base: HfRepository | None = None,
    dtype: DataType | None = None,
    text_only: bool = False,
    tokenizer_dir: Path | None = None,
    keep_base_mtp: bool = False,
) -> HfExportPlan:
    """Decides the config, tensors and files of an export.

    :param base: The Hugging Face repository the model was trained from. Its
        layout, expert layout, dtype, extra config keys, vision tower, MTP
        head, tokenizer and generation config are carried over; the model must
        have its architecture.
    :param dtype: The dtype of every tensor. If ``None``, each tensor keeps
        the dtype it has in ``base`` (in the model without a base).
    :param text_only: If ``True``, writes ``Qwen3_5ForCausalLM`` without the
        vision tower. Implied without a base, which has no tower to carry.
    :param keep_base_mtp: If ``True``, the MTP head is the base's, copied as
        it is, instead of the model's. A model without a head gets the base's
        anyway (a warning says it is untrained). The config's
        ``mtp_num_hidden_layers`` counts the layers of the head the export
        holds, none if it holds none.
    :param tokenizer_dir: Without a base (a model trained from scratch), or
        with a base that holds no tokenizer (fairseq2's download of a Hub
        model: weights and config alone), the Hugging Face tokenizer directory
        the model was trained with: its files are copied and the generation
        config ends text with its end tokens (unless the base has one), so
        transformers can tokenize and stop. Ignored with a base that has a
        tokenizer, which is carried over.
    """
    _check_exportable(config)

    _check_no_adapters(state_dict)

    _check_tied_embeddings(state_dict, config)

    hg_state_dict = to_hg_state_dict(state_dict, config)

    is_vlm = base is not None and base.is_vlm and not text_only

    expert_layout = base.expert_layout if base is not None else None

    hg_state_dict = lay_out_experts(hg_state_dict, expert_layout or "per_expert")

    copy_base_mtp = _copies_base_mtp(hg_state_dict, base, keep_base_mtp)

    if copy_base_mtp:
        hg_state_dict = {k: v for k, v in hg_state_dict.items() if not _MTP_KEY.match(k)}

    if base is not None and config.tied_embeddings:
        # Some tied checkpoints store their (identical) output weights too.
        lm_head_key = "lm_head.weight"

        if lm_head_key in base.tensors:
            hg_state_dict[lm_head_key] = hg_state_dict["model.embed_tokens.weight"]

    if is_vlm:
        # The MTP head too, if the base nests it (some re-exports do).
        nested_mtp = base is not None and any(k.startswith(_VLM_MTP_PREFIX) for k in base.tensors)

        hg_state_dict = {_to_vlm_key(k, nested_mtp): v for k, v in hg_state_dict.items()}

    tensors: dict[str, _PlannedTensor] = {}

    for key, value in hg_state_dict.items():
        if not isinstance(value, Tensor):
            raise TypeError(
                f"`state_dict[{key}]` must be of type `{Tensor}`, but is of type `{type(value)}` instead."
            )

        tensors[key] = _PlannedTensor(value, value.dtype, tuple(value.shape))

    # The base's entry of each tensor of the export.
    base_entries: dict[str, SafetensorsTensor] = {}

    if base is not None:
        check_architecture(base, config)

        base_entries = _match_base_tensors(tensors, base, is_vlm, match_mtp=not copy_base_mtp)

        for key, entry in base.tensors.items():
            if (copy_base_mtp and _MTP_KEY.match(key)) or (is_vlm and _VISUAL_KEY.match(key)):
                if not is_vlm:
                    key = key.removeprefix(VLM_TEXT_PREFIX)

                tensors[key] = _PlannedTensor(entry, entry.dtype, entry.shape)

                base_entries[key] = entry

    if dtype is not None:
        if dtype not in EXPORT_DTYPES.values():
            raise ValueError(
                f"`dtype` must be one of {', '.join(str(d) for d in EXPORT_DTYPES.values())}, but is {dtype} instead."
            )

        config_dtype = dtype
    elif base is not None:
        config_dtype = base.dtype
    else:
        config_dtype = _dominant_dtype(tensors.values())

    for key, tensor in tensors.items():
        if not tensor.dtype.is_floating_point:
            continue

        if dtype is not None:
            target_dtype = dtype
        elif base is not None:
            # The model's MTP head has no entry in a base without one.
            base_entry = base_entries.get(key)

            target_dtype = base.dtype if base_entry is None else base_entry.dtype
        else:
            target_dtype = tensor.dtype

        tensors[key] = _PlannedTensor(tensor.source, target_dtype, tensor.shape)

    mtp_layers = {int(m[1]) for k in tensors if (m := _MTP_LAYER_KEY.match(k))}

    doc = build_hf_config(
        config,
        base=base,
        text_only=not is_vlm,
        dtype=config_dtype,
        num_mtp_layers=len(mtp_layers),
    )

    generation_config = None

    copied_files = [] if base is None else _files_to_copy(base.path, vision=is_vlm)

    if is_vlm and base is not None and not any(f.name == "preprocessor_config.json" for f in copied_files):
        log.warning("{} holds no preprocessor_config.json: the export is a vision-language repository (`{}`) without its image processor, which transformers' AutoProcessor cannot build and vLLM reads at start-up for this architecture. Copy the processor files of the base's Hugging Face repository ({}) into the export, or export with `--text-only`.", base.path, doc["architectures"][0], ", ".join(VISION_PROCESSOR_FILES))  # type: ignore[index]  # fmt: skip

    base_has_tokenizer = base is not None and holds_tokenizer(base.path)

    if base is not None and not base_has_tokenizer:
        # fairseq2 downloads a Hub model's weights and config alone.
        if tokenizer_dir is None:
            log.warning("{} holds no tokenizer, and none is given: the export has none.", base.path)
        else:
            log.info("{} holds no tokenizer: the export ships {}'s, and its end tokens as generation defaults unless the base has some.", base.path, tokenizer_dir)  # fmt: skip

    if tokenizer_dir is not None and not base_has_tokenizer:
        copied_names = {f.name for f in copied_files}

        # Ours replaces the tokenizer's generation defaults, if it has any.
        copied_files += [
            f for f in _files_to_copy(tokenizer_dir, vision=False) if f.name != "generation_config.json" and f.name not in copied_names
        ]

        if "generation_config.json" not in copied_names:
            generation_config = _tokenizer_generation_config(tokenizer_dir)

    if generation_config is None:
        generation_config = _stopping_at_end_of_turn(copied_files)

        if generation_config is not None:
            copied_files = [f for f in copied_files if f.name != "generation_config.json"]

    return HfExportPlan(doc, tensors, copied_files, base, generation_config)


def _tokenizer_generation_config(tokenizer_dir: Path) -> dict[str, object]:
    """Returns generation defaults that end text where the tokenizer does:
    at its EOS token and at ``<|endoftext|>``, as the released models'."""
    tokenizer_config = _read_json_object(tokenizer_dir / "tokenizer_config.json")

    ids = _added_token_ids(tokenizer_dir / "tokenizer.json")

    def token_id(token: object) -> int | None:
        if isinstance(token, dict):  # {"content": ..., ...}
            token = token.get("content")

        return ids.get(token) if isinstance(token, str) else None

    eos_ids = [i for i in (token_id(tokenizer_config.get("eos_token")), ids.get("<|endoftext|>")) if i is not None]

    return {
        "bos_token_id": token_id(tokenizer_config.get("bos_token")),
        "eos_token_id": list(dict.fromkeys(eos_ids)),
        "pad_token_id": token_id(tokenizer_config.get("pad_token")),
    }


def _stopping_at_end_of_turn(copied_files: Sequence[Path]) -> dict[str, object] | None:
    """Returns the copied ``generation_config.json`` with ``<|im_end|>`` of
    the copied tokenizer added to its EOS tokens, or ``None`` where nothing
    needs adding.

    Every assistant turn the SFT recipes train ends at ``<|im_end|>``, where
    transformers' ``generate`` and vLLM stop only if the generation defaults
    say so. A pretrained (``-Base``) repository's defaults may end text at
    ``<|endoftext|>`` alone, as earlier Qwen base models' do, and a model
    fine-tuned from it and exported with them would answer and then go on
    past its answer until the token limit.
    """
    files = {f.name: f for f in copied_files}

    if "generation_config.json" not in files or "tokenizer.json" not in files:
        return None

    end_of_turn = _added_token_ids(files["tokenizer.json"]).get("<|im_end|>")

    if end_of_turn is None:
        return None

    generation_config = _read_json_object(files["generation_config.json"])

    eos = generation_config.get("eos_token_id")

    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else eos

    if not isinstance(eos_ids, list) or not all(isinstance(i, int) for i in eos_ids):
        raise HfExportError(f"`eos_token_id` of {files['generation_config.json']} must be a token id or a list of them, but is {eos!r} instead.")  # fmt: skip

    if end_of_turn in eos_ids:
        return None

    log.info("The generation defaults of {} end text at {} only; the export's end at `<|im_end|>` ({}) too, where every assistant turn the SFT recipes train ends.", files["generation_config.json"], eos_ids, end_of_turn)  # fmt: skip

    return {**generation_config, "eos_token_id": eos_ids + [end_of_turn]}


def _added_token_ids(tokenizer_file: Path) -> dict[str, int]:
    """The ids of the added (special) tokens of a ``tokenizer.json``."""
    added_tokens = _read_json_object(tokenizer_file).get("added_tokens") or []

    return {t["content"]: t["id"] for t in added_tokens if isinstance(t, dict)}  # type: ignore[union-attr]


def _read_json_object(file: Path) -> dict[str, object]:
    try:
        document = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as ex:
        raise HfExportError(f"{file} must be a readable JSON file, but cannot be read: {ex}") from None

    if not isinstance(document, dict):
        raise HfExportError(f"{file} must hold a JSON object, but does not.")

    return document


def _check_no_adapters(state_dict: Mapping[str, Tensor]) -> None:
    """Raises :class:`HfExportError` if ``state_dict`` holds LoRA adapters:
    written beside the base weights, transformers would warn of unexpected
    keys and serve the base model without them."""
    adapter_keys = sorted(key for key in state_dict if is_lora_key(key))

    if adapter_keys:
        raise HfExportError(
            f"The model must hold no unmerged LoRA adapters, but holds {len(adapter_keys)} adapter tensors ({adapter_keys[0]}, ...) instead. Merge them into the weights first (`merge_lora_state_dict`), or write them as a PEFT adapter (`save_peft_adapter`)."
        )


def _check_exportable(config: Qwen35Config) -> None:
    """Rejects what transformers' Qwen3.5 cannot express."""
    if not isinstance(config, Qwen35MoeConfig):
        return

    if config.experts.dense_layers:
        raise HfExportError(
            f"`experts.dense_layers` must be empty for a Qwen3.5-MoE export (transformers has an MoE block in every layer), but is {config.experts.dense_layers} instead."
        )

    if not config.experts.normalize_top_k:
        raise HfExportError(
            "`experts.normalize_top_k` must be True for a Qwen3.5-MoE export (transformers always renormalises the top-k weights), but is False instead."
        )


def _check_tied_embeddings(state_dict: Mapping[str, Tensor], config: Qwen35Config) -> None:
    if not config.tied_embeddings:
        return

    embed = state_dict.get("decoder_frontend.embed.weight")
    final_proj = state_dict.get("final_proj.weight")

    if embed is None or final_proj is None or final_proj is embed:
        return

    if final_proj.data_ptr() == embed.data_ptr() or torch.equal(final_proj, embed):
        return

    raise HfExportError(
        "The model must share its output projection with its embeddings, as `tied_embeddings` says, but has an output projection of its own. Export it with a config whose `tied_embeddings` is False."
    )


def _copies_base_mtp(
    hg_state_dict: Mapping[str, object], base: HfRepository | None, keep_base_mtp: bool
) -> bool:
    """Whether the export takes its MTP head from ``base`` rather than from
    the model (``hg_state_dict``)."""
    if keep_base_mtp and base is None:
        raise HfExportError(
            "`keep_base_mtp` must be False without a base model, but is True instead. The base's MTP head can only be kept when there is a base."
        )

    if base is None or not any(_MTP_KEY.match(k) for k in base.tensors):
        return False

    if not any(_MTP_KEY.match(k) for k in hg_state_dict):
        log.warning(
            "The model has no MTP head (`mtp_num_layers: 0`), so the export carries the one of the base model {}, as it is: it was not trained with the model, and speculative decoding accepts fewer of its draft tokens.",
            base.path,
        )

        return True

    if keep_base_mtp:
        log.info("The export carries the MTP head of the base model {} instead of the model's, as asked.", base.path)

    return keep_base_mtp


def _to_vlm_key(key: str, nested_mtp: bool) -> str:
    if key.startswith("model.") or (nested_mtp and key.startswith("mtp.")):
        return VLM_TEXT_PREFIX + key.removeprefix("model.")

    return key


def check_architecture(base: HfRepository, config: Qwen35Config) -> None:
    """Raises :class:`HfExportError` unless ``base`` has the architecture of
    ``config``: the same family and the same tensor shapes and layers."""
    kind = "Qwen3.5-MoE" if isinstance(config, Qwen35MoeConfig) else "dense Qwen3.5"

    try:
        base_config = qwen35_config_from_hf(base.config)
    except ValueError as ex:
        raise HfExportError(
            f"The base model must be a {kind} model like the exported one, but {base.path} is not: {ex}"
        ) from None

    if isinstance(base_config, Qwen35MoeConfig) != isinstance(config, Qwen35MoeConfig):
        raise HfExportError(
            f"The base model must be a {kind} model like the exported one, but {base.path} is not."
        )

    fields: list[tuple[object, object, str, str]] = [
        (config, base_config, name, hg_name) for name, hg_name in _ARCHITECTURE_FIELDS
    ]

    if isinstance(config, Qwen35MoeConfig) and isinstance(base_config, Qwen35MoeConfig):
        # The dense width is unused: every layer is MoE.
        fields = [f for f in fields if f[2] != "ffn_inner_dim"]

        fields += [
            (config.experts, base_config.experts, name, hg_name)
            for name, hg_name in _MOE_ARCHITECTURE_FIELDS
        ]

    differences = [
        f"{hg_name} (base: {getattr(base_part, name)!r}, model: {getattr(part, name)!r})"
        for part, base_part, name, hg_name in fields
        if getattr(base_part, name) != getattr(part, name)
    ]

    if base_config.get_layer_types() != config.get_layer_types():
        differences.append(
            f"layer_types (base: {base_config.get_layer_types()}, model: {config.get_layer_types()})"
        )

    if differences:
        raise HfExportError(
            f"The base model must have the architecture of the exported model, but {base.path} differs in {'; '.join(differences)}."
        )


def _match_base_tensors(
    tensors: Mapping[str, _PlannedTensor], base: HfRepository, is_vlm: bool, *, match_mtp: bool
) -> dict[str, SafetensorsTensor]:
    """Returns the entry of ``base`` for each of the model's tensors, checking
    that they are the same tensors in name and shape; the MTP head's too if
    ``match_mtp`` and the base has one (a model may bring a head to a base
    without one)."""
    base_keys = {}

    base_has_mtp = any(_MTP_KEY.match(k) for k in base.tensors)

    for key, entry in base.tensors.items():
        if _VISUAL_KEY.match(key) or (_MTP_KEY.match(key) and not match_mtp):
            continue

        if not is_vlm:
            if key.startswith(_VLM_MTP_PREFIX):
                key = key.removeprefix(VLM_TEXT_PREFIX)
            elif key.startswith(VLM_TEXT_PREFIX):
                key = "model." + key.removeprefix(VLM_TEXT_PREFIX)

        base_keys[key] = entry

    if not base_has_mtp:
        tensors = {k: v for k, v in tensors.items() if not _MTP_KEY.match(k)}

    missing = sorted(base_keys.keys() - tensors.keys())
    extra = sorted(tensors.keys() - base_keys.keys())

    if missing or extra:
        raise HfExportError(
            f"The model's tensors must be those of the base model {base.path}, but are not. Only in the base: {', '.join(missing) or 'none'}. Only in the model: {', '.join(extra) or 'none'}."
        )

    mismatches = [
        f"{key} (base: {list(entry.shape)}, model: {list(tensors[key].shape)})"
        for key, entry in base_keys.items()
        if entry.shape != tensors[key].shape
    ]

    if mismatches:
        raise HfExportError(
            f"The model's tensors must have the shapes of those of the base model {base.path}, but differ in {'; '.join(mismatches)}."
        )

    return base_keys


def _dominant_dtype(tensors: Iterable[_PlannedTensor]) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}

    for tensor in tensors:
        if tensor.dtype.is_floating_point:
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + numel(tensor.shape)

    return max(counts, key=counts.__getitem__)


# The files of which one makes a directory a Hugging Face tokenizer.
_TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def holds_tokenizer(path: Path) -> bool:
    """Whether the Hugging Face repository at ``path`` holds a tokenizer; a
    Hub model that fairseq2 downloaded holds its weights and config alone."""
    return any((path / name).is_file() for name in _TOKENIZER_FILES)


def _files_to_copy(path: Path, *, vision: bool) -> list[Path]:
    names = _COPIED_FILES + (VISION_PROCESSOR_FILES if vision else ())

    return [path / name for name in names if (path / name).is_file()]
