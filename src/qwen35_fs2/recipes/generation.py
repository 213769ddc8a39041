"""Parts shared by the inference recipes ``lm generate`` and ``lm
eval_gsm8k``: prompts read like instruction examples, rendered as chat
generation prompts, and responses generated with fairseq2's sequence
generators (incremental decoding) or, for greedy decoding of a model with an
MTP head, speculatively (:mod:`qwen35_fs2.recipes.speculative`)."""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TextIO, cast, final

import torch
from torch import Tensor
from torch.nn import Module
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
from fairseq2.logging import log
from fairseq2.metrics import Mean, MetricBag, Sum
from fairseq2.metrics.common import add_seq_generator_metrics, update_seq_generator_metrics
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import BatchLayout
from fairseq2.recipe.base import RecipeContext
from fairseq2.recipe.config import (
    TOP_K_SAMPLER,
    BeamSearchConfig,
    ReferenceModelSection,
    SamplingConfig,
    SequenceGeneratorSection,
    TokenizerSection,
    TopKSamplerConfig,
)
from fairseq2.recipe.error import RecipeError
from fairseq2.recipe.generator import GeneratorUnit
from fairseq2.task import Task
from fairseq2.utils.validation import ValidationResult

from qwen35_fs2.models.qwen35.tokenizer import QWEN35_TOKENIZER_ASSET
from qwen35_fs2.nn.mtp import find_mtp
from qwen35_fs2.recipes.loss import compute_mtp_loss
from qwen35_fs2.recipes.speculative import GreedyDecoder
from qwen35_fs2.recipes.instruction import (
    ChatEncoder,
    InstructionExample,
    InstructionSource,
    list_instruction_files,
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


@dataclass(kw_only=True)
class SpeculativeDecodingSection:
    enabled: bool = False
    """If ``True``, decodes each prompt greedily with the model's MTP head
    drafting the token after the next and the trunk verifying it, which gives
    the responses of plain greedy decoding in fewer trunk passes. Needs a
    model with an MTP head and greedy decoding (``seq_generator``: sampling
    with the top-k sampler, ``k: 1``); reports the acceptance of the drafts
    and the tokens per second."""

    compare_with_plain: bool = True
    """If ``True``, also decodes each prompt plainly, one token per trunk
    pass, to report the speed-up over it in the same run and count the
    responses that differ (``Speculative Mismatches``; only the last bits of
    a two-token pass can make one)."""


GENERATION_PAD_TOKEN: Final = "<|vision_pad|>"
"""The pad token of the generation recipes' tokenizer, a token that a text
model never writes: the tokenizer's default pad, ``<|endoftext|>``, ends
responses, and fairseq2's generators never choose the pad token."""


def generation_tokenizer_section() -> TokenizerSection:
    """The default ``tokenizer`` section of the generation recipes: the
    Qwen3.5 tokenizer, padding with :data:`GENERATION_PAD_TOKEN`."""
    return TokenizerSection(name=QWEN35_TOKENIZER_ASSET, config_overrides={"pad_token": GENERATION_PAD_TOKEN})

# The tokens that end a Qwen3.5 response besides the tokenizer's EOS: the
# chat turn's end and the document's, the `eos_token_id` of the released
# models' generation config, at which transformers and vLLM stop.
_STOP_TOKENS: Final = ("<|im_end|>", "<|endoftext|>")


def get_stop_indices(tokenizer: Tokenizer) -> frozenset[int]:
    """Returns the tokens at which a response ends: the tokenizer's EOS and
    ``<|im_end|>`` and ``<|endoftext|>`` where the vocabulary has them.

    fairseq2's sequence generators stop at the EOS token alone; a response
    is cut after the first of the others (:class:`ResponseUnit`), so that a
    model that ends its text with ``<|endoftext|>`` (a base model, a
    continued-pretraining checkpoint) is scored on that text, not on what it
    writes after it.
    """
    indices = set() if tokenizer.vocab_info.eos_idx is None else {tokenizer.vocab_info.eos_idx}

    encoder = tokenizer.create_raw_encoder()

    for token in _STOP_TOKENS:
        token_indices = encoder(token).tolist()

        if len(token_indices) == 1:
            indices.add(token_indices[0])

    return frozenset(indices)


def check_generation_pad(tokenizer: Tokenizer) -> None:
    """Raises :class:`RecipeError` if the pad token of ``tokenizer`` ends
    responses: fairseq2's generators, and ours, never choose the pad token,
    so the model could not end a response with it."""
    stop_indices = get_stop_indices(tokenizer)

    pad_idx = tokenizer.vocab_info.pad_idx

    if pad_idx in stop_indices:
        raise RecipeError(
            f"The tokenizer's pad token must not be a token that ends responses ({', '.join(map(str, sorted(stop_indices)))}), since the generator never chooses the pad token, but is {pad_idx} instead. Set `tokenizer.config_overrides.pad_token` to a token that the model never writes, such as {GENERATION_PAD_TOKEN} (the default)."
        )


@final
@dataclass(frozen=True)
class ResponseBudget:
    """The number of tokens a response may hold before its end token, the
    same for a prompt whatever the batch it is generated in.

    fairseq2 0.8.1's generators give a batch ``max_gen_len`` tokens after
    its *longest* prompt (capped at ``max_seq_len``), the last one forced to
    the end token. :class:`ResponseUnit` generates each prompt with prompts
    of its own length only, so that this is the prompt's own allowance, as
    it is for the speculative decoder, which decodes a prompt at a time.
    Every response is cut to the tokens its prompt gets as the longest of
    its batch, less the forced end token (the speculative decoder forces
    none), so that both paths give the same; one without an end token in
    them is *truncated*, and recorded as such.
    """

    max_gen_len: int | tuple[float, int]
    """As in the generator's configuration: fairseq2's decoder-only sampling
    and beam search generators take ``b`` of ``(a, b)``."""

    max_seq_len: int

    @staticmethod
    def of(section: SequenceGeneratorSection, model: Module) -> ResponseBudget:
        """The budget of the generator of ``section`` for ``model``."""
        config = section.config

        if not isinstance(config, SamplingConfig | BeamSearchConfig):
            raise RecipeError(f"`seq_generator.config` must be a sampling or beam search configuration, but is a `{type(config).__name__}` instead.")

        max_seq_len = cast(int, model.max_seq_len)

        if config.max_seq_len is not None:
            max_seq_len = min(max_seq_len, config.max_seq_len)

        return ResponseBudget(config.max_gen_len, max_seq_len)

    def for_prompt(self, prompt_len: int) -> int:
        """Returns the tokens a response to a prompt of ``prompt_len``
        tokens may hold before its end token."""
        max_gen_len = self.max_gen_len if isinstance(self.max_gen_len, int) else self.max_gen_len[1]

        return max(min(max_gen_len, self.max_seq_len - prompt_len) - 1, 0)


def _cut_response(seq: Tensor, budget: int, stop_indices: frozenset[int]) -> tuple[Tensor, bool]:
    """Returns the first ``budget`` tokens of ``seq`` up to and with the
    first token of ``stop_indices`` among them, and whether there is none
    (the response is truncated)."""
    seq = seq[:budget]

    stops = torch.isin(seq, torch.tensor(sorted(stop_indices), device=seq.device)).nonzero()

    if stops.numel() == 0:
        return seq, True

    return seq[: int(stops[0]) + 1], False


def validate_response_generator(section: SequenceGeneratorSection) -> ValidationResult:
    """Checks that the sequence generator of a response recipe returns the
    responses alone: with ``echo_prompt`` its outputs would start with the
    chat prompt, which the records, the answer extraction (which may then
    read the question's last number) and the MTP acceptance would take for
    the response."""
    result = ValidationResult()

    if isinstance(section.config, SamplingConfig | BeamSearchConfig) and section.config.echo_prompt:
        result.add_error(
            "`config.echo_prompt` must be `False`, since the responses are recorded and scored without their prompt, but is `True` instead."
        )

    return result


def validate_response_model(section: ReferenceModelSection) -> ValidationResult:
    """Checks that the model of a response recipe runs uncompiled: under
    ``torch.compile`` incremental decoding fails at its first step in torch
    2.9 (the attention layers' key-value cache makes a ``BatchLayout`` inside
    the compiled layer, whose ``maybe_mark_dynamic`` dynamo refuses to
    trace; fairseq2's own models fail alike)."""
    result = ValidationResult()

    if section.compile:
        result.add_error(
            "`compile` must be `False`, since incremental decoding does not run under `torch.compile` (torch 2.9), but is `True` instead."
        )

    return result


def read_prompt_examples(
    section: PromptDatasetSection, *, require_response: bool
) -> list[InstructionExample]:
    """Reads the examples of ``section.sources``, the first
    ``section.max_num_examples`` of them if set."""
    files = list_instruction_files(section.sources, get_asset_download_manager())

    examples = read_instruction_examples(files, require_response=require_response)

    if section.max_num_examples is not None:
        examples = examples[: section.max_num_examples]

    return examples


def create_response_task(
    context: RecipeContext,
    section: PromptDatasetSection,
    examples: Sequence[InstructionExample],
    unit_kls: type[ResponseUnit],
    output_name: str,
    *,
    seq_generator: SequenceGeneratorSection,
    speculative: SpeculativeDecodingSection,
) -> Task:
    """Returns the task that generates a response to each of ``examples``
    with ``unit_kls``, writing to ``OUTPUT_DIR/<output_name>/``."""
    tokenizer = context.get_tokenizer()

    check_generation_pad(tokenizer)

    generator = context.get_seq_generator()

    decoder = None

    if speculative.enabled:
        decoder = _create_speculative_decoder(generator.model, tokenizer, seq_generator)

    reader = create_prompt_reader(
        examples,
        tokenizer,
        context.gangs,
        batch_size=section.batch_size,
        prefetch=section.prefetch,
    )

    unit = unit_kls(
        generator,
        tokenizer,
        open_output_stream(context, output_name),
        budget=ResponseBudget.of(seq_generator, generator.model),
        speculative_decoder=decoder,
        compare_with_plain=speculative.compare_with_plain,
    )

    return context.create_generator(unit, reader)


def _create_speculative_decoder(
    model: Module, tokenizer: Tokenizer, seq_generator: SequenceGeneratorSection
) -> GreedyDecoder:
    config = seq_generator.config

    sampler = config.sampler if isinstance(config, SamplingConfig) else None

    greedy = (
        sampler is not None
        and sampler.name == TOP_K_SAMPLER
        and isinstance(sampler.config, TopKSamplerConfig)
        and sampler.config.k == 1
    )

    if not greedy:
        raise RecipeError(
            "`seq_generator` must decode greedily (`name: sampling` with the `top_k` sampler and `k: 1`) when `speculative_decoding.enabled` is `True`, but does not."
        )

    assert isinstance(config, SamplingConfig)

    if not isinstance(config.max_gen_len, int):
        raise RecipeError(
            f"`seq_generator.config.max_gen_len` must be an integer when `speculative_decoding.enabled` is `True`, but is {config.max_gen_len} instead."
        )

    # The decoder ends a response at its first end token, wherever it is.
    if config.min_gen_len != 1:
        raise RecipeError(
            f"`seq_generator.config.min_gen_len` must be 1 when `speculative_decoding.enabled` is `True`, but is {config.min_gen_len} instead."
        )

    mtp = find_mtp(model)

    if not isinstance(model, TransformerLM) or mtp is None:
        raise RecipeError(
            "`model` must have an MTP head (`mtp_num_layers: 1`, as the released checkpoints) when `speculative_decoding.enabled` is `True`, but has none."
        )

    return GreedyDecoder(model, tokenizer.vocab_info, max_gen_len=config.max_gen_len, max_seq_len=config.max_seq_len, mtp=mtp, stop_indices=get_stop_indices(tokenizer))


def create_prompt_reader(
    examples: Sequence[InstructionExample],
    tokenizer: Tokenizer,
    gangs: Gangs,
    *,
    batch_size: int,
    prefetch: int,
) -> DataPipelineReader[SequenceBatch]:
    """Returns a reader of this rank's share of ``examples`` as batches of
    generation prompts of one length each; ``batch.example`` holds the
    examples.

    fairseq2 0.8.1's generators count a batch's steps from its longest
    prompt: they forbid the end token until the longest prompt has
    ``min_gen_len`` generated tokens, so a shorter prompt cannot end its
    response in its first tokens beside a longer one (and beam search ranks
    its hypotheses over the longest prompt's allowance). A prompt's response
    would then depend on the prompts batched with it: on the batch size, on
    the number of ranks. Batched with prompts of its own length only, every
    prompt gets the allowance and the end-token rule it gets alone (greedy
    responses are then those of the prompt alone, up to the rounding of
    batched products; sampled ones draw with their batch). Each rank takes
    every ``dp.size``-th example from its ``dp.rank``-th, encodes them, and
    batches them longest first, up to ``batch_size`` of one length.
    """
    encoder = ChatEncoder(tokenizer)

    by_length: dict[int, list[dict[str, Any]]] = {}

    for example in examples[gangs.dp.rank :: gangs.dp.size]:
        indices = encoder.encode_prompt(example["prompt"])

        by_length.setdefault(len(indices), []).append({**example, "indices": indices})

    batches = [
        prompts[idx : idx + batch_size]
        for _, prompts in sorted(by_length.items(), reverse=True)
        for idx in range(0, len(prompts), batch_size)
    ]

    vocab_info = tokenizer.vocab_info

    # The generator reads the prompt lengths, not the pad value.
    pad_idx = vocab_info.pad_idx if vocab_info.pad_idx is not None else vocab_info.eos_idx

    builder = read_sequence(batches)

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
        *,
        budget: ResponseBudget,
        speculative_decoder: GreedyDecoder | None = None,
        compare_with_plain: bool = True,
    ) -> None:
        """
        :param budget: The budget of ``generator``'s responses.
        :param speculative_decoder: If not ``None``, generates the responses
            in place of ``generator``.
        """
        self._generator = generator
        self._budget = budget
        self._stop_indices = get_stop_indices(tokenizer)
        self._decoder = tokenizer.create_decoder(skip_special_tokens=True)
        self._output_stream = output_stream
        self._speculative_decoder = speculative_decoder
        self._compare_with_plain = compare_with_plain

        model = generator.model

        self._mtp = find_mtp(model) if isinstance(model, TransformerLM) else None

    @override
    def prepare_metric_bag(self, metric_bag: MetricBag) -> None:
        if self._speculative_decoder is None:
            add_seq_generator_metrics(metric_bag)
        else:
            metric_bag.add("speculative_acceptance", Mean())
            metric_bag.add("speculative_tokens_per_second", Mean())

            if self._compare_with_plain:
                metric_bag.add("plain_tokens_per_second", Mean())
                metric_bag.add("speculative_speedup", Mean())
                metric_bag.add("speculative_mismatches", Sum())

        if self._mtp is not None:
            metric_bag.add("mtp_acceptance", Mean())

        metric_bag.add("num_truncated", Sum())

    @final
    @override
    def process_batch(self, batch: SequenceBatch, metric_bag: MetricBag) -> None:
        seqs, seqs_layout = batch.as_input()

        if self._speculative_decoder is None:
            response_seqs = self._generate(seqs, seqs_layout, metric_bag)
        else:
            response_seqs = self._generate_speculatively(seqs, seqs_layout, metric_bag)

        cuts = [
            _cut_response(seq, self._budget.for_prompt(seq_len), self._stop_indices)
            for seq, seq_len in zip(response_seqs, seqs_layout.seq_lens)
        ]

        response_seqs = [seq for seq, _ in cuts]

        truncated = [is_truncated for _, is_truncated in cuts]

        metric_bag.get("num_truncated", Sum).update(sum(truncated))

        responses = [self._decoder(seq) for seq in response_seqs]

        if self._mtp is not None:
            self._measure_mtp_acceptance(seqs, seqs_layout, response_seqs, metric_bag)

        records = self.make_records(get_batch_examples(batch), responses, metric_bag)

        if self._output_stream is None:
            return

        for record, is_truncated in zip(records, truncated):
            record["truncated"] = is_truncated

            self._output_stream.write(json.dumps(record, ensure_ascii=False))
            self._output_stream.write("\n")

        self._output_stream.flush()

    def _generate(self, seqs: Tensor, seqs_layout: BatchLayout, metric_bag: MetricBag) -> list[Tensor]:
        """Returns the first hypothesis of fairseq2's generator for each
        prompt, generated with the prompts of its length (see
        :func:`create_prompt_reader`; a batch of it is one call)."""
        rows_of_length: dict[int, list[int]] = {}

        for row, seq_len in enumerate(seqs_layout.seq_lens):
            rows_of_length.setdefault(seq_len, []).append(row)

        response_seqs: list[Tensor | None] = [None] * len(seqs_layout.seq_lens)

        for seq_len, rows in rows_of_length.items():
            prompts = seqs[rows, :seq_len]

            output = self._generator(prompts, BatchLayout.of(prompts))

            update_seq_generator_metrics(metric_bag, output)

            for row, hypotheses in zip(rows, output.hypotheses):
                if not hypotheses:
                    raise InternalError("The sequence generator returned no hypothesis.")

                response_seqs[row] = hypotheses[0].seq

        return cast(list[Tensor], response_seqs)

    def _generate_speculatively(
        self, seqs: Tensor, seqs_layout: BatchLayout, metric_bag: MetricBag
    ) -> list[Tensor]:
        """Returns the speculatively decoded response to each prompt, one
        prompt at a time, and the plain ones' speed and agreement if
        ``compare_with_plain``."""
        decoder = self._speculative_decoder

        if decoder is None:
            raise InternalError("The unit has no speculative decoder.")

        response_seqs = []

        num_drafts = num_accepted = num_tokens = num_plain_tokens = num_mismatches = 0

        time_speculative = time_plain = 0.0

        for row, seq_len in enumerate(seqs_layout.seq_lens):
            prompt = seqs[row, :seq_len]

            output = decoder.speculative(prompt)

            response_seqs.append(output.tokens)

            num_drafts += output.num_drafts
            num_accepted += output.num_accepted
            num_tokens += output.tokens.numel()

            time_speculative += output.elapsed_time

            if self._compare_with_plain:
                plain = decoder.plain(prompt)

                time_plain += plain.elapsed_time

                num_plain_tokens += plain.tokens.numel()

                num_mismatches += int(not torch.equal(plain.tokens, output.tokens))

        metric_bag.get("speculative_acceptance", Mean).update(
            num_accepted / max(num_drafts, 1), weight=num_drafts
        )

        # Weighted by time, the mean is the total tokens over the total time.
        metric_bag.get("speculative_tokens_per_second", Mean).update(
            num_tokens / time_speculative, weight=time_speculative
        )

        if self._compare_with_plain:
            metric_bag.get("plain_tokens_per_second", Mean).update(
                num_plain_tokens / time_plain, weight=time_plain
            )

            metric_bag.get("speculative_speedup", Mean).update(
                time_plain / time_speculative, weight=time_speculative
            )

            metric_bag.get("speculative_mismatches", Sum).update(num_mismatches)

            if num_mismatches:
                log.warning("Speculative and plain greedy decoding gave different responses to {} prompts of the batch; the speculative ones are written.", num_mismatches)

        return response_seqs

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
