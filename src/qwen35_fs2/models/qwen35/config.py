"""Configuration of the dense Qwen3.5 family and its architecture presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

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

    mtp_num_layers: int = 0
    """
    The number of decoder layers of the multi-token-prediction head (Hugging
    Face's ``mtp_num_hidden_layers``): ``0`` for none, or ``1``, the head of
    the released checkpoints, which predicts the token after next (see
    :class:`~qwen35_fs2.nn.mtp.Qwen35MultiTokenPredictor`).
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

        if self.mtp_num_layers not in (0, 1):
            result.add_error(
                f"`mtp_num_layers` must be 0 or 1 (the released Qwen3.5 checkpoints have one MTP layer), but is {self.mtp_num_layers} instead."
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
