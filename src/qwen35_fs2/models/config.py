"""Configuration of the dense Qwen3.5 family and its architecture presets."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Final, Literal, TypeVar

from fairseq2.runtime.config_registry import ConfigRegistrar
from fairseq2.runtime.dependency import DependencyContainer
from fairseq2.utils.validation import ValidationError, ValidationResult

from qwen35_fs2.ops import GdnBackendRequest

QWEN35_FAMILY: Final = "qwen35"

LayerType = Literal["linear_attention", "full_attention"]

ENDOFTEXT_IDX: Final = 248_044
"""The index of ``<|endoftext|>``, the pad token of the Qwen3.5 vocabulary."""


@dataclass(kw_only=True)
class Qwen35Config:
    """Holds the configuration of a dense Qwen3.5 language model.

    The defaults describe Qwen3.5-0.8B.
    """

    model_dim: int = 1024
    """The dimensionality of the model."""

    max_seq_len: int = 262_144
    """The maximum sequence length."""

    vocab_size: int = 248_320
    """The size of the embedding table (padded beyond the tokenizer's size)."""

    pad_idx: int | None = ENDOFTEXT_IDX
    """
    The index of the pad token in the embedding table. Its embedding receives
    no gradient. ``<|endoftext|>`` in the released vocabulary.
    """

    tied_embeddings: bool = True
    """If ``True``, ties the embedding table and the output projection."""

    num_layers: int = 24
    """The number of decoder layers."""

    layer_types: list[LayerType] | None = None
    """
    The token mixer of every decoder layer. If ``None``, every
    ``full_attention_interval``-th layer is ``full_attention`` and the others
    are ``linear_attention`` (Gated DeltaNet).
    """

    full_attention_interval: int = 4
    """Used to derive ``layer_types`` when it is ``None``."""

    num_attn_heads: int = 8
    """The number of query heads in full-attention layers."""

    num_key_value_heads: int = 2
    """The number of key/value heads in full-attention layers (GQA)."""

    head_dim: int = 256
    """The dimensionality of full-attention heads."""

    partial_rotary_factor: float = 0.25
    """The fraction of each attention head's dimensions that RoPE rotates."""

    rope_theta: float = 10_000_000.0
    """The coefficient of the long-term decay of the rotary encoder."""

    num_linear_key_heads: int = 16
    """The number of query/key heads in Gated DeltaNet layers."""

    num_linear_value_heads: int = 16
    """
    The number of value heads in Gated DeltaNet layers; a multiple of
    ``num_linear_key_heads``.
    """

    linear_key_head_dim: int = 128
    """The dimensionality of Gated DeltaNet query/key heads."""

    linear_value_head_dim: int = 128
    """The dimensionality of Gated DeltaNet value heads."""

    linear_conv_kernel_size: int = 4
    """The width of the causal depthwise convolution of Gated DeltaNet."""

    ffn_inner_dim: int = 3584
    """The dimensionality of the inner projection of the SwiGLU MLP."""

    rms_norm_eps: float = 1e-6
    """The epsilon of every RMS normalization."""

    init_std: float = 0.02
    """
    The standard deviation of the normal initialization of projections and
    embeddings (Hugging Face's ``initializer_range``).
    """

    gdn_backend: GdnBackendRequest = "auto"
    """
    The kernels of the Gated DeltaNet layers: ``torch`` (pure PyTorch, runs
    anywhere), ``fla`` (fla's Triton kernels; CUDA only, or CPU under
    Triton's interpreter), or ``auto`` (``fla`` on CUDA when importable,
    otherwise ``torch``). Resolved in every forward pass for the device of
    the input, so a model moved between devices follows.
    """

    def get_layer_types(self) -> list[LayerType]:
        """Returns the token mixer of every decoder layer."""
        if self.layer_types is not None:
            return list(self.layer_types)

        interval = self.full_attention_interval

        return [
            "full_attention" if (idx + 1) % interval == 0 else "linear_attention"
            for idx in range(self.num_layers)
        ]

    def validate(self) -> ValidationResult:
        result = ValidationResult()

        def check_positive(name: str) -> None:
            value = getattr(self, name)

            if value < 1:
                result.add_error(
                    f"`{name}` must be greater than or equal to 1, but is {value} instead."
                )

        for name in (
            "model_dim",
            "max_seq_len",
            "vocab_size",
            "num_layers",
            "full_attention_interval",
            "num_attn_heads",
            "num_key_value_heads",
            "head_dim",
            "num_linear_key_heads",
            "num_linear_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_size",
            "ffn_inner_dim",
        ):
            check_positive(name)

        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                result.add_error(
                    f"`layer_types` must have `num_layers` ({self.num_layers}) entries, but has {len(self.layer_types)} instead."
                )

            for idx, layer_type in enumerate(self.layer_types):
                if layer_type not in ("linear_attention", "full_attention"):
                    result.add_error(
                        f"`layer_types[{idx}]` must be 'linear_attention' or 'full_attention', but is '{layer_type}' instead."
                    )

        if self.num_key_value_heads >= 1:
            if self.num_attn_heads % self.num_key_value_heads != 0:
                result.add_error(
                    f"`num_attn_heads` ({self.num_attn_heads}) must be a multiple of `num_key_value_heads` ({self.num_key_value_heads})."
                )

        if self.num_linear_key_heads >= 1:
            if self.num_linear_value_heads % self.num_linear_key_heads != 0:
                result.add_error(
                    f"`num_linear_value_heads` ({self.num_linear_value_heads}) must be a multiple of `num_linear_key_heads` ({self.num_linear_key_heads})."
                )

        rotary_dim = self.rotary_dim

        if rotary_dim < 2 or rotary_dim % 2 != 0 or rotary_dim > self.head_dim:
            result.add_error(
                f"`head_dim * partial_rotary_factor` must be an even number between 2 and `head_dim` ({self.head_dim}), but is {self.head_dim * self.partial_rotary_factor} instead."
            )

        if self.pad_idx is not None and not 0 <= self.pad_idx < self.vocab_size:
            result.add_error(
                f"`pad_idx` must be in the range [0, {self.vocab_size}) of the vocabulary, but is {self.pad_idx} instead."
            )

        if self.init_std <= 0.0:
            result.add_error(
                f"`init_std` must be greater than 0, but is {self.init_std} instead."
            )

        if self.gdn_backend not in ("auto", "torch", "fla"):
            result.add_error(
                f"`gdn_backend` must be 'auto', 'torch', or 'fla', but is '{self.gdn_backend}' instead."
            )

        return result

    @property
    def rotary_dim(self) -> int:
        """The number of dimensions of each attention head that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)


def check_config(config: Qwen35Config) -> None:
    """Raises a :class:`ValidationError` listing every problem of ``config``."""
    result = config.validate()

    if result.has_error():
        raise ValidationError(result)


def register_qwen35_configs(container: DependencyContainer) -> None:
    arch = ConfigRegistrar(container, Qwen35Config)

    # Values from the released `config.json` files (see
    # docs/architecture.md); the tie flags of 2B and 4B and the value heads of
    # 9B come from secondary sources. Loading through an asset card takes them
    # from the checkpoint's own config.json (`adopt_hf_architecture`).

    @arch("qwen35_0.8b")
    def qwen35_0p8b() -> Qwen35Config:
        return Qwen35Config()

    @arch("qwen35_2b")
    def qwen35_2b() -> Qwen35Config:
        config = Qwen35Config()

        config.model_dim = 2048
        config.ffn_inner_dim = 6144

        return config

    @arch("qwen35_4b")
    def qwen35_4b() -> Qwen35Config:
        config = Qwen35Config()

        config.model_dim = 2560
        config.num_layers = 32
        config.num_attn_heads = 16
        config.num_key_value_heads = 4
        config.num_linear_value_heads = 32
        config.ffn_inner_dim = 9216

        return config

    @arch("qwen35_9b")
    def qwen35_9b() -> Qwen35Config:
        config = Qwen35Config()

        config.model_dim = 4096
        config.tied_embeddings = False
        config.num_layers = 32
        config.num_attn_heads = 16
        config.num_key_value_heads = 4
        config.num_linear_value_heads = 32
        config.ffn_inner_dim = 12_288

        return config

    @arch("qwen35_27b")
    def qwen35_27b() -> Qwen35Config:
        config = Qwen35Config()

        config.model_dim = 5120
        config.tied_embeddings = False
        config.num_layers = 64
        config.num_attn_heads = 24
        config.num_key_value_heads = 4
        config.num_linear_value_heads = 48
        config.ffn_inner_dim = 17_408

        return config

    # Small random-weight models for tests and the demo.

    @arch("qwen35_tiny")
    def qwen35_tiny() -> Qwen35Config:
        return tiny_qwen35_config()

    @arch("qwen35_demo")
    def qwen35_demo() -> Qwen35Config:
        """A small model over the real 248k vocabulary that trains on CPU."""
        config = tiny_qwen35_config()

        config.vocab_size = 248_320
        config.pad_idx = ENDOFTEXT_IDX
        config.model_dim = 128
        config.num_attn_heads = 4
        config.num_key_value_heads = 2
        config.head_dim = 32
        config.num_linear_key_heads = 2
        config.num_linear_value_heads = 4
        config.linear_key_head_dim = 32
        config.linear_value_head_dim = 32
        config.ffn_inner_dim = 384
        config.max_seq_len = 4096

        return config


def tiny_qwen35_config() -> Qwen35Config:
    """Returns a 4-layer, 64-dimensional Qwen3.5 configuration for tests."""
    return Qwen35Config(
        model_dim=64,
        max_seq_len=2048,
        vocab_size=1024,
        pad_idx=0,
        tied_embeddings=True,
        num_layers=4,
        num_attn_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_linear_key_heads=2,
        num_linear_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        ffn_inner_dim=128,
    )


_SUPPORTED_TEXT_MODEL_TYPES: Final = ("qwen3_5_text",)

MOE_MODEL_TYPES: Final = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
"""The Hugging Face model types that :func:`qwen35_config_from_hf` reads as
a :class:`~qwen35_fs2.models.moe_config.Qwen35MoeConfig`."""


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
    :class:`~qwen35_fs2.models.moe_config.Qwen35MoeConfig`.
    """
    model_type = hg_config.get("model_type")

    if model_type in MOE_MODEL_TYPES:
        # Imported here: the MoE configuration builds on this module.
        from qwen35_fs2.models.moe_config import qwen35_moe_config_from_hf

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
:class:`~qwen35_fs2.models.moe_config.Qwen35MoeConfig` that a Hugging Face
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
    )


def _read_rope_parameters(text: Mapping[str, object]) -> tuple[float, float]:
    """Returns ``(rope_theta, partial_rotary_factor)``.

    transformers 5 nests them in ``rope_parameters``; older files keep them
    at the top level of the text config.
    """
    rope = text.get("rope_parameters")

    if rope is None:
        rope = text.get("rope_scaling") or {}

    if not isinstance(rope, Mapping):
        raise ValueError(
            f"`rope_parameters` must be a mapping, but is of type `{type(rope).__name__}` instead."
        )

    rope_type = rope.get("rope_type", rope.get("type", "default"))

    if rope_type != "default":
        raise ValueError(
            f"Only the 'default' RoPE type is supported, but `rope_parameters.rope_type` is '{rope_type}'."
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
