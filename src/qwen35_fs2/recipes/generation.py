"""Parts shared by the inference recipes ``lm generate`` and ``lm
eval_gsm8k``: prompts read like instruction examples, rendered as chat
generation prompts, and responses generated with fairseq2's sequence
generators (incremental decoding)."""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO, cast, final

import torch
from torch import Tensor
from typing_extensions import override

from fairseq2.assets import get_asset_download_manager
from fairseq2.data import Collater
from fairseq2.data.data_pipeline import SequenceData, read_sequence
from fairseq2.data.tokenizers import Tokenizer
from fairseq2.datasets import DataPipelineReader, DataReadError, SequenceBatch, SyncMode
from fairseq2.error import InternalError
from fairseq2.file_system import FileMode
from fairseq2.gang import Gangs
from fairseq2.generation import SequenceGenerator
from fairseq2.metrics import Mean, MetricBag
from fairseq2.metrics.common import add_seq_generator_metrics, update_seq_generator_metrics
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import BatchLayout
from fairseq2.recipe.base import RecipeContext
from fairseq2.recipe.generator import GeneratorUnit
from fairseq2.task import Task
from fairseq2.utils.validation import ValidationResult

from qwen35_fs2.nn.mtp import find_mtp
from qwen35_fs2.recipes.loss import compute_mtp_loss
from qwen35_fs2.recipes.instruction import (
    ChatEncoder,
    InstructionExample,
    InstructionSource,
    read_instruction_examples,
)


@dataclass(kw_only=True)
class PromptDatasetSection:
    sources: list[InstructionSource] = field(default_factory=list)
    """The prompts: the ``question`` or ``src`` of each row."""

    batch_size: int = 8
    """The number of prompts generated for at once on each rank."""

    max_num_examples: int | None = None
    """If not ``None``, only the first prompts of the sources."""

    prefetch: int = 2
    """The number of batches prepared in the background."""

    def validate(self) -> ValidationResult:
        result = ValidationResult()

        if not self.sources:
            result.add_error("`sources` must have at least one source, but has none.")

        if self.batch_size < 1:
            result.add_error(
                f"`batch_size` must be greater than or equal to 1, but is {self.batch_size} instead."
            )

        if self.max_num_examples is not None and self.max_num_examples < 1:
            result.add_error(
                f"`max_num_examples` must be greater than or equal to 1, but is {self.max_num_examples} instead."
            )

        if self.prefetch < 0:
            result.add_error(
                f"`prefetch` must be greater than or equal to 0, but is {self.prefetch} instead."
            )

        return result


def read_prompt_examples(
    section: PromptDatasetSection, *, require_response: bool
) -> list[InstructionExample]:
    """Reads the examples of ``section.sources``, the first
    ``section.max_num_examples`` of them if set."""
    examples = read_instruction_examples(
        section.sources, get_asset_download_manager(), require_response=require_response
    )

    if section.max_num_examples is not None:
        examples = examples[: section.max_num_examples]

    return examples


def create_response_task(
    context: RecipeContext,
    section: PromptDatasetSection,
    examples: Sequence[InstructionExample],
    unit_kls: type[ResponseUnit],
    output_name: str,
) -> Task:
    """Returns the task that generates a response to each of ``examples``
    with ``unit_kls``, writing to ``OUTPUT_DIR/<output_name>/``."""
    tokenizer = context.get_tokenizer()

    reader = create_prompt_reader(
        examples,
        tokenizer,
        context.gangs,
        batch_size=section.batch_size,
        prefetch=section.prefetch,
    )

    unit = unit_kls(
        context.get_seq_generator(), tokenizer, open_output_stream(context, output_name)
    )

    return context.create_generator(unit, reader)


def create_prompt_reader(
    examples: Sequence[InstructionExample],
    tokenizer: Tokenizer,
    gangs: Gangs,
    *,
    batch_size: int,
    prefetch: int,
) -> DataPipelineReader[SequenceBatch]:
    """Returns a reader of this rank's share of ``examples`` as right-padded
    batches of generation prompts; ``batch.example`` holds the examples."""
    encoder = ChatEncoder(tokenizer)

    def encode(example: InstructionExample) -> dict[str, Any]:
        return {**example, "indices": encoder.encode_prompt(example["prompt"])}

    vocab_info = tokenizer.vocab_info

    # The generator reads the prompt lengths, not the pad value.
    pad_idx = vocab_info.pad_idx if vocab_info.pad_idx is not None else vocab_info.eos_idx

    builder = read_sequence(list(examples))

    builder.shard(gangs.dp.rank, gangs.dp.size, allow_uneven=True)

    builder.map(encode)

    builder.bucket(batch_size)

    builder.map(Collater(pad_value=pad_idx))

    builder.prefetch(prefetch)

    def to_batch(data: dict[str, Any]) -> SequenceBatch:
        indices = cast(SequenceData, data.pop("indices"))

        return SequenceBatch(indices["seqs"], indices["seq_lens"], example=data)

    pipeline = builder.map(to_batch).and_return()

    # Ranks with fewer prompts wait for the others instead of cutting them
    # short.
    return DataPipelineReader[SequenceBatch](
        pipeline, gangs, sync=True, sync_mode=SyncMode.UNTIL_LAST
    )


def open_output_stream(context: RecipeContext, name: str) -> TextIO | None:
    """Opens ``OUTPUT_DIR/<name>/rank_<dp_rank>.jsonl`` on the first rank of
    each tensor-parallel group, and returns ``None`` on the others."""
    gangs = context.gangs

    if gangs.tp.rank != 0:
        return None

    file = context.output_dir.joinpath(name, f"rank_{gangs.dp.rank}.jsonl")

    file_system = context.file_system

    file_system.make_directory(file.parent)

    return file_system.open_text(file, mode=FileMode.WRITE)


def get_batch_examples(batch: SequenceBatch) -> list[dict[str, str]]:
    """Returns the examples of a batch of :func:`create_prompt_reader`."""
    data = batch.example

    if not isinstance(data, Mapping):
        raise DataReadError(
            f"`batch.example` must be a mapping, but is of type `{type(data)}` instead."
        )

    columns = {key: data[key] for key in ("id", "prompt", "response")}

    return [dict(zip(columns, values)) for values in zip(*columns.values())]


class ResponseUnit(GeneratorUnit[SequenceBatch]):
    """Generates one response per prompt of a batch (the first hypothesis)
    and writes one JSONL record per example. Subclasses make the records and
    any metrics of their own."""

    def __init__(
        self,
        generator: SequenceGenerator,
        tokenizer: Tokenizer,
        output_stream: TextIO | None,
    ) -> None:
        self._generator = generator
        self._decoder = tokenizer.create_decoder(skip_special_tokens=True)
        self._output_stream = output_stream

        model = generator.model

        self._mtp = find_mtp(model) if isinstance(model, TransformerLM) else None

    @override
    def prepare_metric_bag(self, metric_bag: MetricBag) -> None:
        add_seq_generator_metrics(metric_bag)

        if self._mtp is not None:
            metric_bag.add("mtp_acceptance", Mean())

    @final
    @override
    def process_batch(self, batch: SequenceBatch, metric_bag: MetricBag) -> None:
        seqs, seqs_layout = batch.as_input()

        output = self._generator(seqs, seqs_layout)

        update_seq_generator_metrics(metric_bag, output)

        responses = []

        response_seqs = []

        for hypotheses in output.hypotheses:
            if not hypotheses:
                raise InternalError("The sequence generator returned no hypothesis.")

            responses.append(self._decoder(hypotheses[0].seq))

            response_seqs.append(hypotheses[0].seq)

        if self._mtp is not None:
            self._measure_mtp_acceptance(seqs, seqs_layout, response_seqs, metric_bag)

        records = self.make_records(get_batch_examples(batch), responses, metric_bag)

        if self._output_stream is None:
            return

        for record in records:
            self._output_stream.write(json.dumps(record, ensure_ascii=False))
            self._output_stream.write("\n")

        self._output_stream.flush()

    @torch.no_grad()
    def _measure_mtp_acceptance(
        self, seqs: Tensor, seqs_layout: BatchLayout, responses: list[Tensor], metric_bag: MetricBag
    ) -> None:
        """Updates ``mtp_acceptance`` with the fraction of the response
        tokens (after the first) that the MTP head drafts as the model
        generated them: on its own greedy responses, the tokens one-step MTP
        speculative decoding would accept."""
        model = self._generator.model

        if not isinstance(model, TransformerLM) or self._mtp is None:
            raise InternalError("The model has no MTP head.")

        # Each prompt and its response as a document of a packed batch, the
        # responses the targets.
        docs, masks = [], []

        for row, (seq_len, response) in enumerate(zip(seqs_layout.seq_lens, responses)):
            prompt = seqs[row, :seq_len]

            docs.append(torch.cat([prompt, response.to(prompt.device)]))

            # The first response token comes from the prompt's pass, not
            # from a draft.
            masks.append(torch.arange(docs[-1].size(0), device=prompt.device) > seq_len)

        batch = SequenceBatch(torch.cat(docs), [d.size(0) for d in docs], packed=True, target_mask=torch.cat(masks))

        input_batch, target_batch = batch.as_auto_regressive()

        input_seqs, input_layout = input_batch.as_input()

        embeds, embeds_layout = model.decoder_frontend(input_seqs, input_layout)

        hidden = model.decoder(embeds, embeds_layout)

        loss = compute_mtp_loss(
            model, self._mtp, hidden, input_layout, target_batch.seqs, target_batch.target_mask, acceptance=True
        )

        if loss.num_accepted is None:
            raise InternalError("`loss.num_accepted` is `None`.")

        metric_bag.get("mtp_acceptance", Mean).update(
            loss.num_accepted / loss.num_targets.clamp(min=1), weight=loss.num_targets
        )

    @abstractmethod
    def make_records(
        self, examples: list[dict[str, str]], responses: list[str], metric_bag: MetricBag
    ) -> list[dict[str, object]]:
        """Returns the output record of each example given its response."""
