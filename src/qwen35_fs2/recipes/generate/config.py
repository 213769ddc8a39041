"""The configuration of ``lm generate``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fairseq2.recipe.config import (
    CommonSection,
    GangSection,
    GeneratorSection,
    ReferenceModelSection,
    SamplingConfig,
    SequenceGeneratorSection,
    TokenizerSection,
)
from fairseq2.utils.validation import ValidationResult

from qwen35_fs2.recipes.generation import (
    PromptDatasetSection,
    SpeculativeDecodingSection,
    generation_tokenizer_section,
    validate_response_generator,
    validate_response_model,
)


@dataclass(kw_only=True)
class GenerateConfig:
    output_dir: Path | None = None
    """
    Where the run writes its logs and generations, if the command line names
    none. If ``None``, ``outputs/generate``.
    """

    model: ReferenceModelSection = field(
        default_factory=lambda: ReferenceModelSection(name="qwen35_0.8b")
    )

    dataset: PromptDatasetSection = field(default_factory=lambda: PromptDatasetSection())

    tokenizer: TokenizerSection = field(default_factory=generation_tokenizer_section)
    """The tokenizer; its pad token must be none that ends a response (see
    :data:`~qwen35_fs2.recipes.generation.GENERATION_PAD_TOKEN`)."""

    gang: GangSection = field(default_factory=lambda: GangSection())

    generator: GeneratorSection = field(default_factory=lambda: GeneratorSection())

    seq_generator: SequenceGeneratorSection = field(
        default_factory=lambda: SequenceGeneratorSection(
            config=SamplingConfig(max_gen_len=1024)
        )
    )

    speculative_decoding: SpeculativeDecodingSection = field(
        default_factory=lambda: SpeculativeDecodingSection()
    )

    common: CommonSection = field(default_factory=lambda: CommonSection())

    def validate(self) -> ValidationResult:
        result = ValidationResult()

        result.add_sub_result("model", validate_response_model(self.model))

        result.add_sub_result("seq_generator", validate_response_generator(self.seq_generator))

        return result
