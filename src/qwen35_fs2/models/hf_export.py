"""Exports Qwen3.5 models as Hugging Face repositories that transformers and
vLLM load in place of the released ones.

fairseq2's own exporter cannot do this: it instantiates the config class of
the installed transformers (4.57 has no Qwen3.5), fills every unset key with
that class's defaults, writes fp32 and drops every tensor it does not model
(the vision tower, the multi-token-prediction head). Here ``config.json`` is
written by this package with every key explicit, tensors keep the base
model's dtype, and what this package does not train is copied from the base
repository unchanged.

The state dicts are converted by renaming keys only: our zero-centred norms
store their weights as the checkpoints do (see
:class:`~qwen35_fs2.nn.normalization.ZeroCenteredRMSNorm`), so no tensor
is shifted by 1 on import or export, and a round trip is bitwise.
"""

from __future__ import annotations

import copy
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, final

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from fairseq2.data_type import DataType
from fairseq2.model_checkpoint import CorruptModelCheckpointError
from fairseq2.models.hg import HuggingFaceConfig, HuggingFaceConverter
from fairseq2.models.utils.checkpoint import convert_state_dict, create_reverse_key_map

from qwen35_fs2.models.qwen35.config import ENDOFTEXT_IDX, QWEN35_FAMILY, Qwen35Config
from qwen35_fs2.hf.config import get_text_config, qwen35_config_from_hf
from qwen35_fs2.hf.config import load_hf_config
from qwen35_fs2.models.qwen35.interop import convert_to_hg_state_dict
from qwen35_fs2.models.qwen35_moe.config import QWEN35_MOE_FAMILY, Qwen35MoeConfig
from qwen35_fs2.models.qwen35_moe.interop import _HG_MOE_KEY_MAP
from qwen35_fs2.models.sharded_loading import SafetensorsTensor, index_safetensors

EXPORTABLE_FAMILIES: Final = (QWEN35_FAMILY, QWEN35_MOE_FAMILY)
"""The model families whose checkpoints this package exports."""

DEFAULT_MAX_SHARD_SIZE: Final = 5_000_000_000
"""The largest shard, in bytes, as in ``save_pretrained`` (``"5GB"``)."""

EXPORT_DTYPES: Final = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
"""The dtypes an export can be written in, by their Hugging Face names."""

ExpertLayout = Literal["fused", "per_expert"]

_VLM_TEXT_PREFIX: Final = "model.language_model."

_VISUAL_KEY: Final = re.compile(r"^model\.visual\.")

_MTP_KEY: Final = re.compile(r"^mtp\.")

_MTP_LAYER_KEY: Final = re.compile(r"^mtp\.layers\.([0-9]+)\.")

_FUSED_EXPERT_KEY: Final = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")

_PER_EXPERT_KEY: Final = re.compile(
    r"^(.*\.mlp\.experts\.)([0-9]+)\.(gate_proj|up_proj|down_proj)\.weight$"
)

_INDEX_FILE: Final = "model.safetensors.index.json"

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

_VISION_FILES: Final = (
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
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

_HG_MOE_REVERSE_KEY_MAP: Final = create_reverse_key_map(_HG_MOE_KEY_MAP)

_HG_MOE_REVERSE_KEY_MAP_PATTERNS: Final = tuple(
    re.compile(p) for p in _HG_MOE_REVERSE_KEY_MAP
)


class HfExportError(Exception):
    """Raised when an export cannot be made; nothing has been written then."""


@final
class HfRepository:
    """A Hugging Face model directory: its ``config.json`` and the location,
    dtype and shape of each tensor, read from the safetensors headers.

    Tensor data is read only when an export copies it.
    """

    def __init__(
        self, path: Path, config: dict[str, object], tensors: dict[str, SafetensorsTensor]
    ) -> None:
        self.path = path
        self.config = config
        self.tensors = tensors

    @staticmethod
    def open(path: str | Path) -> HfRepository:
        path = Path(path)

        if not path.is_dir():
            raise HfExportError(
                f"The base model must be a Hugging Face model directory, but {path} is not a directory."
            )

        try:
            config = load_hf_config(path)
        except (FileNotFoundError, ValueError) as ex:
            raise HfExportError(str(ex)) from None

        try:
            tensors = index_safetensors(path, _safetensors_files(path))
        except (CorruptModelCheckpointError, OSError) as ex:
            raise HfExportError(str(ex)) from None

        return HfRepository(path, config, tensors)

    @property
    def is_vlm(self) -> bool:
        """``True`` for the released vision-language layout."""
        return "text_config" in self.config or any(
            key.startswith(_VLM_TEXT_PREFIX) for key in self.tensors
        )

    @property
    def expert_layout(self) -> ExpertLayout | None:
        """How the MoE experts are stored; ``None`` for a dense model."""
        for key in self.tensors:
            if _FUSED_EXPERT_KEY.search(key):
                return "fused"

            if _PER_EXPERT_KEY.match(key):
                return "per_expert"

        return None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the config declares, else that of most tensor elements."""
        for section in (get_text_config(self.config), self.config):
            for key in ("dtype", "torch_dtype"):
                name = section.get(key)

                if isinstance(name, str) and name in EXPORT_DTYPES:
                    return EXPORT_DTYPES[name]

        counts: dict[torch.dtype, int] = {}

        for entry in self.tensors.values():
            if entry.dtype.is_floating_point:
                counts[entry.dtype] = counts.get(entry.dtype, 0) + _numel(entry.shape)

        if not counts:
            raise HfExportError(f"{self.path} must hold floating-point tensors, but has none.")

        return max(counts, key=counts.__getitem__)

    def read(self, keys: Sequence[str]) -> dict[str, Tensor]:
        """Reads the tensors under ``keys``, opening each file once."""
        by_file: dict[Path, list[str]] = {}

        for key in keys:
            by_file.setdefault(self.tensors[key].file, []).append(key)

        tensors = {}

        for file, file_keys in by_file.items():
            with safe_open(file, framework="pt") as reader:
                for key in file_keys:
                    tensors[key] = reader.get_tensor(key)

        return tensors


def _safetensors_files(path: Path) -> list[Path]:
    index_file = path / _INDEX_FILE

    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as ex:
            raise HfExportError(f"{index_file} must be a safetensors index with a `weight_map`, but cannot be read as one: {ex!r}") from None

        return [path / name for name in sorted(set(weight_map.values()))]

    files = sorted(path.glob("*.safetensors"))

    if not files:
        raise HfExportError(
            f"The base model must hold its weights as safetensors, but {path} has no *.safetensors file."
        )

    return files


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1

    for dim in shape:
        numel *= dim

    return numel


@final
@dataclass(frozen=True)
class _PlannedTensor:
    """A tensor of the export: taken from the model or copied from the base."""

    source: Tensor | SafetensorsTensor
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


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
    :param tokenizer_dir: Without a base (a model trained from scratch), the
        Hugging Face tokenizer directory the model was trained with: its files
        are copied and the generation config ends text with its end tokens,
        so transformers can tokenize and stop. Ignored with a base, whose
        tokenizer is carried over.
    """
    _check_exportable(config)

    _check_tied_embeddings(state_dict, config)

    hg_state_dict = to_hg_state_dict(state_dict, config)

    is_vlm = base is not None and base.is_vlm and not text_only

    expert_layout = base.expert_layout if base is not None else None

    hg_state_dict = lay_out_experts(hg_state_dict, expert_layout or "per_expert")

    if base is not None and config.tied_embeddings:
        # Some tied checkpoints store their (identical) output weights too.
        lm_head_key = "lm_head.weight"

        if lm_head_key in base.tensors:
            hg_state_dict[lm_head_key] = hg_state_dict["model.embed_tokens.weight"]

    if is_vlm:
        hg_state_dict = {_to_vlm_key(k): v for k, v in hg_state_dict.items()}

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
        _check_architecture(base, config)

        base_entries = _match_base_tensors(tensors, base, is_vlm)

        for key, entry in base.tensors.items():
            if _MTP_KEY.match(key) or (is_vlm and _VISUAL_KEY.match(key)):
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
            target_dtype = base_entries[key].dtype
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

    if base is not None:
        copied_files = _files_to_copy(base.path, vision=is_vlm)
    elif tokenizer_dir is not None:
        # Ours replaces the tokenizer's generation defaults, if it has any.
        copied_files = [
            f for f in _files_to_copy(tokenizer_dir, vision=False) if f.name != "generation_config.json"
        ]

        generation_config = _tokenizer_generation_config(tokenizer_dir)
    else:
        copied_files = []

    return HfExportPlan(doc, tensors, copied_files, base, generation_config)


def _tokenizer_generation_config(tokenizer_dir: Path) -> dict[str, object]:
    """Returns generation defaults that end text where the tokenizer does:
    at its EOS token and at ``<|endoftext|>``, as the released models'."""

    def read(name: str) -> dict[str, object]:
        file = tokenizer_dir / name

        try:
            document = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as ex:
            raise HfExportError(f"{file} must be a readable JSON file of the tokenizer, but cannot be read: {ex}") from None

        if not isinstance(document, dict):
            raise HfExportError(f"{file} must hold a JSON object, but does not.")

        return document

    tokenizer_config = read("tokenizer_config.json")

    added_tokens = read("tokenizer.json").get("added_tokens") or []

    ids = {t["content"]: t["id"] for t in added_tokens if isinstance(t, dict)}  # type: ignore[union-attr]

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


def to_hg_state_dict(
    state_dict: Mapping[str, object], config: Qwen35Config
) -> dict[str, object]:
    """Converts a fairseq2 state dict of either family to Hugging Face keys
    in the text-only layout; MoE experts come out fused, as fairseq2 stores
    them."""
    if not isinstance(config, Qwen35MoeConfig):
        return convert_to_hg_state_dict(state_dict, config)

    moe_state_dict = {}
    other_state_dict = {}

    for key, value in state_dict.items():
        if any(p.match(key) for p in _HG_MOE_REVERSE_KEY_MAP_PATTERNS):
            moe_state_dict[key] = value
        else:
            other_state_dict[key] = value

    converted = convert_to_hg_state_dict(other_state_dict, config)

    converted.update(convert_state_dict(moe_state_dict, _HG_MOE_REVERSE_KEY_MAP))

    return converted


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


def _to_vlm_key(key: str) -> str:
    if key.startswith("model."):
        return _VLM_TEXT_PREFIX + key.removeprefix("model.")

    return key


def _check_architecture(base: HfRepository, config: Qwen35Config) -> None:
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
    tensors: Mapping[str, _PlannedTensor], base: HfRepository, is_vlm: bool
) -> dict[str, SafetensorsTensor]:
    """Returns the entry of ``base`` for each of the model's tensors, checking
    that they are the same tensors in name and shape."""
    base_keys = {}

    for key, entry in base.tensors.items():
        if _MTP_KEY.match(key) or _VISUAL_KEY.match(key):
            continue

        if not is_vlm and key.startswith(_VLM_TEXT_PREFIX):
            key = "model." + key.removeprefix(_VLM_TEXT_PREFIX)

        base_keys[key] = entry

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
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + _numel(tensor.shape)

    return max(counts, key=counts.__getitem__)


def _files_to_copy(path: Path, *, vision: bool) -> list[Path]:
    names = _COPIED_FILES + (_VISION_FILES if vision else ())

    return [path / name for name in names if (path / name).is_file()]


class StateDictShapeError(HfExportError):
    """Raised when expert tensors cannot be laid out as asked."""

    def __init__(self, key: str, expected: str) -> None:
        super().__init__(f"`{key}` must be {expected}, but is not.")


def lay_out_experts(
    hg_state_dict: Mapping[str, object], layout: ExpertLayout
) -> dict[str, object]:
    """Stores the MoE experts of a Hugging Face state dict in ``layout``.

    ``"fused"``: ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows
    first) and ``mlp.experts.down_proj`` ``[E, H, I]``, as in the released
    checkpoints. ``"per_expert"``: ``mlp.experts.{e}.{gate,up,down}_proj.weight``,
    as transformers 5.24's ``save_pretrained`` writes. Other keys pass through.
    """
    output: dict[str, object] = {}

    per_expert: dict[str, dict[int, dict[str, Tensor]]] = {}

    for key, value in hg_state_dict.items():
        if (m := _FUSED_EXPERT_KEY.search(key)) is not None and layout == "per_expert":
            prefix = key.removesuffix(m[1])

            if not isinstance(value, Tensor) or value.dim() != 3:
                raise StateDictShapeError(key, "a 3-D tensor")

            if m[1] == "gate_up_proj":
                if value.size(1) % 2 != 0:
                    raise StateDictShapeError(key, "[E, 2I, H] with an even second dimension")

                for expert_idx, gate_up in enumerate(value):
                    gate, up = gate_up.chunk(2, dim=0)

                    output[f"{prefix}{expert_idx}.gate_proj.weight"] = gate
                    output[f"{prefix}{expert_idx}.up_proj.weight"] = up
            else:
                for expert_idx, down in enumerate(value):
                    output[f"{prefix}{expert_idx}.down_proj.weight"] = down
        elif (m := _PER_EXPERT_KEY.match(key)) is not None and layout == "fused":
            if not isinstance(value, Tensor):
                raise StateDictShapeError(key, "a tensor")

            per_expert.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = value
        else:
            output[key] = value

    for prefix, experts in per_expert.items():
        if sorted(experts) != list(range(len(experts))):
            raise StateDictShapeError(
                f"{prefix}*", f"experts numbered 0 to {len(experts) - 1}, not {sorted(experts)}"
            )

        gate_ups, downs = [], []

        for expert_idx in range(len(experts)):
            projs = experts[expert_idx]

            if projs.keys() != {"gate_proj", "up_proj", "down_proj"}:
                raise StateDictShapeError(
                    f"{prefix}{expert_idx}.*", "gate_proj, up_proj and down_proj"
                )

            gate_ups.append(torch.cat([projs["gate_proj"], projs["up_proj"]], dim=0))

            downs.append(projs["down_proj"])

        output[prefix + "gate_up_proj"] = torch.stack(gate_ups)
        output[prefix + "down_proj"] = torch.stack(downs)

    return output


def build_hf_config(
    config: Qwen35Config,
    *,
    base: HfRepository | None,
    text_only: bool,
    dtype: torch.dtype,
    num_mtp_layers: int,
) -> dict[str, object]:
    """Builds the ``config.json`` document of an export.

    Every key is set explicitly: those that describe the language model come
    from ``config``; the others (vision tower, special token ids, keys this
    package does not model) from ``base``, else the released values.
    """
    dtype_name = _dtype_name(dtype)

    if base is None:
        base_text: Mapping[str, object] = {}
    else:
        base_text = get_text_config(base.config)

    text = {**_released_text_defaults(config), **base_text}

    text.update(_text_entries(config))

    if isinstance(config, Qwen35MoeConfig):
        # transformers' MoE text config has no dense width.
        text.pop("intermediate_size", None)

    # transformers 5 nests RoPE in `rope_parameters`; older files use
    # `rope_scaling` and a top-level `rope_theta`.
    rope: dict[str, object] = {
        "mrope_section": _mrope_section(config.rotary_dim),
        "mrope_interleaved": True,
    }

    for key in ("rope_scaling", "rope_parameters"):
        base_rope = text.pop(key, None)

        if isinstance(base_rope, Mapping):
            rope.update(base_rope)

    rope.pop("type", None)

    rope.update(
        rope_type="default",
        rope_theta=config.rope_theta,
        partial_rotary_factor=config.partial_rotary_factor,
    )

    text["rope_parameters"] = rope

    if "rope_theta" in text:
        text["rope_theta"] = config.rope_theta

    text["mtp_num_hidden_layers"] = num_mtp_layers

    moe = isinstance(config, Qwen35MoeConfig)

    if text_only:
        text.pop("torch_dtype", None)

        return {
            **text,
            "architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
            "model_type": text["model_type"],
            "dtype": dtype_name,
        }

    if base is None:
        raise ValueError("`base` must be given for the vision-language layout, but is None.")

    for key in ("dtype", "torch_dtype"):
        if key in text:
            text[key] = dtype_name

    doc = copy.deepcopy(base.config)

    doc.setdefault(
        "architectures",
        ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
    )

    doc["text_config"] = text
    doc["tie_word_embeddings"] = config.tied_embeddings
    doc["dtype"] = dtype_name

    if "torch_dtype" in doc:
        doc["torch_dtype"] = dtype_name

    return doc


def _text_entries(config: Qwen35Config) -> dict[str, object]:
    """The text-config keys that ``config`` determines."""
    layer_types = config.get_layer_types()

    entries: dict[str, object] = {
        "model_type": "qwen3_5_text",
        "vocab_size": config.vocab_size,
        "hidden_size": config.model_dim,
        "intermediate_size": config.ffn_inner_dim,
        "num_hidden_layers": config.num_layers,
        "layer_types": layer_types,
        "num_attention_heads": config.num_attn_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "attention_bias": False,
        "attn_output_gate": True,
        "linear_num_key_heads": config.num_linear_key_heads,
        "linear_num_value_heads": config.num_linear_value_heads,
        "linear_key_head_dim": config.linear_key_head_dim,
        "linear_value_head_dim": config.linear_value_head_dim,
        "linear_conv_kernel_dim": config.linear_conv_kernel_size,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.rms_norm_eps,
        "initializer_range": config.init_std,
        "partial_rotary_factor": config.partial_rotary_factor,
        "tie_word_embeddings": config.tied_embeddings,
        "pad_token_id": config.pad_idx,
    }

    if isinstance(config, Qwen35MoeConfig):
        entries.update(
            model_type="qwen3_5_moe_text",
            num_experts=config.experts.num_experts,
            num_experts_per_tok=config.experts.top_k,
            moe_intermediate_size=config.experts.inner_dim,
            shared_expert_intermediate_size=config.experts.shared_expert_inner_dim,
        )

    # Only where it describes `layer_types`; transformers prefers the list.
    interval = config.full_attention_interval

    if layer_types == [
        "full_attention" if (idx + 1) % interval == 0 else "linear_attention"
        for idx in range(config.num_layers)
    ]:
        entries["full_attention_interval"] = interval

    return entries


def _released_text_defaults(config: Qwen35Config) -> dict[str, object]:
    """The text-config keys of the released models that ``Qwen35Config`` does
    not model; a base's own values take precedence."""
    # The released text configs end text with <|endoftext|>.
    eos_idx = ENDOFTEXT_IDX if config.vocab_size > ENDOFTEXT_IDX else None

    defaults: dict[str, object] = {
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": eos_idx,
        "use_cache": True,
        "mtp_use_dedicated_embeddings": False,
        "mamba_ssm_dtype": "float32",
    }

    if isinstance(config, Qwen35MoeConfig):
        defaults.update(router_aux_loss_coef=0.001, output_router_logits=False)

    return defaults


def _mrope_section(rotary_dim: int) -> list[int]:
    """Splits the rotary frequencies over (T, H, W) as the released [11, 11,
    10] splits 32; with text alone the three positions are equal and the split
    has no effect."""
    base, rest = divmod(rotary_dim // 2, 3)

    return [base + int(rest > 0), base + int(rest > 1), base]


def _dtype_name(dtype: torch.dtype) -> str:
    for name, value in EXPORT_DTYPES.items():
        if value == dtype:
            return name

    raise ValueError(
        f"`dtype` must be one of {', '.join(EXPORT_DTYPES)}, but is {dtype} instead."
    )


def write_hf_export(
    plan: HfExportPlan,
    out_dir: str | Path,
    *,
    force: bool = False,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> None:
    """Writes ``plan`` as a Hugging Face repository at ``out_dir``.

    The repository is written into a hidden temporary directory next to
    ``out_dir`` and renamed into place once complete, so ``out_dir`` never
    holds a partial export; on any failure the temporary directory is removed.

    :param force: If ``True``, replaces a non-empty ``out_dir``; otherwise
        that is an error.
    :param max_shard_size: The largest shard in bytes; a larger tensor gets a
        shard of its own.
    """
    if max_shard_size < 1:
        raise ValueError(
            f"`max_shard_size` must be greater than or equal to 1, but is {max_shard_size} instead."
        )

    out_dir = Path(out_dir).absolute()

    check_output_dir(out_dir, base=plan.base, force=force)

    with _StagingDir(out_dir) as staging_dir:
        _write_shards(plan, staging_dir.path, max_shard_size)

        _write_json(staging_dir.path / "config.json", plan.config)

        if plan.generation_config is not None:
            _write_json(staging_dir.path / "generation_config.json", plan.generation_config)

        for file in plan.copied_files:
            shutil.copyfile(file, staging_dir.path / file.name)

            _fsync(staging_dir.path / file.name)

        staging_dir.commit()


def check_output_dir(
    out_dir: str | Path, *, base: HfRepository | None = None, force: bool = False
) -> None:
    """Raises :class:`HfExportError` if an export may not be written to
    ``out_dir``; checked again on writing, and before loading a model by the
    command line, so that it fails early."""
    out_dir = Path(out_dir).absolute()

    if out_dir.exists() and not out_dir.is_dir():
        raise HfExportError(
            f"The output must be a directory, but {out_dir} is a file."
        )

    if base is not None:
        base_path = base.path.resolve()

        if out_dir.resolve() == base_path or out_dir.resolve() in base_path.parents:
            raise HfExportError(
                f"The output directory must not hold the base model, but {out_dir} holds {base.path}."
            )

    if not force and out_dir.is_dir() and any(out_dir.iterdir()):
        raise HfExportError(
            f"The output directory must be empty or absent, but {out_dir} has files. Replace them with `--force` (`force=True` in Python)."
        )


@final
class _StagingDir:
    """A hidden directory next to the output that becomes the output on
    :meth:`commit` and is removed otherwise."""

    def __init__(self, out_dir: Path) -> None:
        self._out_dir = out_dir
        self._path: Path | None = None
        self._created_parents: list[Path] = []
        self._committed = False

    def __enter__(self) -> _StagingDir:
        parent = self._out_dir.parent

        missing = [p for p in (parent, *parent.parents) if not p.exists()]

        try:
            for directory in reversed(missing):
                directory.mkdir()

                self._created_parents.append(directory)

            self._path = _make_unique_dir(parent, f".{self._out_dir.name}", ".partial")
        except OSError as ex:
            self._remove_created_parents()

            raise HfExportError(
                f"The export cannot be written next to {self._out_dir}: {ex.strerror or ex}."
            ) from ex

        return self

    @property
    def path(self) -> Path:
        if self._path is None:
            raise RuntimeError("The staging directory is used outside its `with` block.")

        return self._path

    def commit(self) -> None:
        staging_path = self.path

        # safetensors creates its files private to their owner; they get the
        # mode of the JSON files, that of any file the user creates.
        file_mode = (staging_path / "config.json").stat().st_mode & 0o777

        for file in staging_path.glob("*.safetensors"):
            file.chmod(file_mode)

        _fsync(staging_path)

        out_dir = self._out_dir

        if out_dir.is_dir() and any(out_dir.iterdir()):
            # Replaced with `force`: moved aside first, so that a crash between
            # the two renames leaves the old export recoverable, never a mix.
            old_dir = _make_unique_dir(out_dir.parent, f".{out_dir.name}", ".old")

            out_dir.rename(old_dir / out_dir.name)

            staging_path.rename(out_dir)

            shutil.rmtree(old_dir)
        else:
            # Renaming onto an empty directory replaces it atomically.
            os.replace(staging_path, out_dir)

        _fsync(out_dir.parent)

        self._committed = True

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if self._committed:
            return

        if self._path is not None:
            shutil.rmtree(self._path, ignore_errors=True)

        self._remove_created_parents()

        if isinstance(exc, (OSError, SafetensorError)):
            raise HfExportError(
                f"Writing the export to {self._out_dir} failed, and nothing was left behind: {exc}"
            ) from exc

    def _remove_created_parents(self) -> None:
        for directory in reversed(self._created_parents):
            try:
                directory.rmdir()
            except OSError:
                break


def _make_unique_dir(parent: Path, prefix: str, suffix: str) -> Path:
    """Creates a new directory, with the mode of any directory the user
    creates (unlike ``tempfile.mkdtemp``, which makes it private)."""
    while True:
        path = parent / f"{prefix}.{secrets.token_hex(4)}{suffix}"

        try:
            path.mkdir()
        except FileExistsError:
            continue

        return path


def _write_shards(plan: HfExportPlan, staging_dir: Path, max_shard_size: int) -> None:
    shards: list[list[str]] = []

    shard_size = 0

    for key, tensor in plan.tensors.items():
        if not shards or (shard_size > 0 and shard_size + tensor.num_bytes > max_shard_size):
            shards.append([])

            shard_size = 0

        shards[-1].append(key)

        shard_size += tensor.num_bytes

    weight_map = {}

    for shard_idx, keys in enumerate(shards):
        name = f"model-{shard_idx + 1:05d}-of-{len(shards):05d}.safetensors"

        save_file(_materialize(plan, keys), staging_dir / name, metadata={"format": "pt"})

        _fsync(staging_dir / name)

        for key in keys:
            weight_map[key] = name

    index = {
        "metadata": {
            "total_size": sum(t.num_bytes for t in plan.tensors.values()),
            "total_parameters": sum(_numel(t.shape) for t in plan.tensors.values()),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }

    _write_json(staging_dir / _INDEX_FILE, index)


def _materialize(plan: HfExportPlan, keys: Sequence[str]) -> dict[str, Tensor]:
    """Returns the tensors of one shard on the CPU in their export dtypes,
    each in storage of its own as safetensors requires."""
    copied_keys = [k for k in keys if isinstance(plan.tensors[k].source, SafetensorsTensor)]

    if copied_keys:
        if plan.base is None:
            raise RuntimeError("A tensor to copy from the base has no base.")

        copied = plan.base.read(copied_keys)
    else:
        copied = {}

    tensors = {}

    for key in keys:
        planned = plan.tensors[key]

        source = planned.source if isinstance(planned.source, Tensor) else copied[key]

        tensors[key] = source.detach().to(device="cpu", dtype=planned.dtype, copy=True).contiguous()

    return tensors


def _write_json(file: Path, document: object) -> None:
    file.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    _fsync(file)


def _fsync(path: Path) -> None:
    """Flushes ``path`` to disk, so that the final rename publishes complete
    files even across a power loss."""
    fd = os.open(path, os.O_RDONLY)

    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    :param tokenizer_dir: Without ``base``, the Hugging Face tokenizer
        directory to ship with the model; see :func:`plan_hf_export`.

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
    )

    write_hf_export(plan, out_dir, force=force, max_shard_size=max_shard_size)


@final
class _Qwen35HuggingFaceConverter(HuggingFaceConverter):
    """Gives fairseq2's export API the text-only form of an export.

    fairseq2's own saver cannot write it with transformers 4.57 (no Qwen3.5
    config class); training-time export runs :mod:`qwen35_fs2.export_cli`
    instead, see :func:`qwen35_fs2.export_cli.hand_over_fairseq2_hg_export`.
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
