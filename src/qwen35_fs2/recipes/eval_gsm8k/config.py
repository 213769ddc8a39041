"""The configuration of ``lm eval_gsm8k``; the defaults evaluate Qwen3.5-0.8B
on the GSM8K test set with greedy decoding."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fairseq2.recipe.config import (
    TOP_K_SAMPLER,
    CommonSection,
    GangSection,
    GeneratorSection,
    ReferenceModelSection,
    SamplerChoice,
    SamplingConfig,
    SequenceGeneratorSection,
    TokenizerSection,
    TopKSamplerConfig,
)
from fairseq2.utils.validation import ValidationResult

from qwen35_fs2.recipes.generation import (
    PromptDatasetSection,
    SpeculativeDecodingSection,
    generation_tokenizer_section,
    validate_response_generator,
    validate_response_model,
)
from qwen35_fs2.recipes.instruction import InstructionSource


@dataclass(kw_only=True)
class EvalGsm8kConfig:
    output_dir: Path | None = None
    """
    Where the run writes its logs, metrics and generations, if the command line
    names none. If ``None``, ``outputs/eval_gsm8k``.
    """

    model: ReferenceModelSection = field(
        default_factory=lambda: ReferenceModelSection(name="qwen35_0.8b")
    )

    dataset: PromptDatasetSection = field(
        default_factory=lambda: PromptDatasetSection(
            sources=[
                InstructionSource(path="hg://openai/gsm8k", pattern="main/test-*.parquet")
            ]
        )
    )

    tokenizer: TokenizerSection = field(default_factory=generation_tokenizer_section)
    """The tokenizer; its pad token must be none that ends a response (see
    :data:`~qwen35_fs2.recipes.generation.GENERATION_PAD_TOKEN`)."""

    gang: GangSection = field(default_factory=lambda: GangSection())

    generator: GeneratorSection = field(default_factory=lambda: GeneratorSection())

    seq_generator: SequenceGeneratorSection = field(
        default_factory=lambda: SequenceGeneratorSection(
            # Greedy decoding: top-k sampling with k = 1.
            config=SamplingConfig(
                sampler=SamplerChoice(name=TOP_K_SAMPLER, config=TopKSamplerConfig(k=1)),
                max_gen_len=512,
            )
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
