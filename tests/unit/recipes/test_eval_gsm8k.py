from __future__ import annotations

import io
import json
from unittest.mock import Mock

import pytest
import torch
from torch import Tensor

from fairseq2.gang import create_fake_gangs
from fairseq2.generation import GenerationCounters, Hypothesis, SequenceGenerator, SequenceGeneratorOutput
from fairseq2.metrics import Mean, MetricBag, Sum
from fairseq2.nn import BatchLayout
from fairseq2.recipe.error import RecipeError

from qwen35_fs2.models.qwen35.tokenizer import Qwen35Tokenizer, Qwen35TokenizerConfig, get_qwen35_tokenizer_dir, load_qwen35_tokenizer
from qwen35_fs2.recipes.eval_gsm8k import Gsm8kEvalUnit
from qwen35_fs2.recipes.generation import GENERATION_PAD_TOKEN, ResponseBudget, check_generation_pad, create_prompt_reader, get_stop_indices
from qwen35_fs2.recipes.instruction import ChatEncoder

CPU = torch.device("cpu")

_EXAMPLES = [
    {"id": "a", "prompt": "What is 1,000 + 234?", "response": "1000 + 234 = <<1000+234=1234>>1234\n#### 1,234"},
    {"id": "b", "prompt": "What is 3 - 10?", "response": "3 - 10 = <<3-10=-7>>-7\n#### -7"},
    {"id": "c", "prompt": "Half of 7?", "response": "7 / 2 = <<7/2=3.5>>3.5\n#### 3.5"},
]

# The model's answers: right in another notation (then `<|endoftext|>`, and a
# text of its own after it, as a base model may go on), wrong, right without
# a marker.
_GENERATIONS = [
    "So the total is 1234.\n#### 1234<|endoftext|>Question: What is 2 + 3?\nAnswer: 5\n#### 5",
    "It is 7.\n#### 7",
    "Half of 7 is 3.50 apples.",
]


def _fake_generator(tokenizer: Qwen35Tokenizer, prompts: list[Tensor]) -> SequenceGenerator:
    encoder = tokenizer.create_encoder(mode="prompt_response")

    def generate(seqs: Tensor, seqs_layout: BatchLayout) -> SequenceGeneratorOutput:
        # The prompts arrive as rendered by the chat template, each with
        # prompts of its length only.
        assert not seqs_layout.padded

        rows = [next(idx for idx, prompt in enumerate(prompts) if torch.equal(seq, prompt)) for seq in seqs]

        hypotheses = [[Hypothesis(encoder(_GENERATIONS[row]), score=None, step_scores=None)] for row in rows]

        return SequenceGeneratorOutput(hypotheses, GenerationCounters(num_generated_elements=30, generation_time=0.5))

    return Mock(spec=SequenceGenerator, side_effect=generate)


class TestGsm8kEvalUnit:
    def test_scores_final_answers_and_writes_every_generation(self, tokenizer: Qwen35Tokenizer) -> None:
        reader = create_prompt_reader(_EXAMPLES, tokenizer, create_fake_gangs(CPU), batch_size=3, prefetch=0)

        encoder = ChatEncoder(tokenizer)

        generator = _fake_generator(tokenizer, [encoder.encode_prompt(e["prompt"]) for e in _EXAMPLES])

        stream = io.StringIO()

        unit = Gsm8kEvalUnit(generator, tokenizer, stream, budget=ResponseBudget(512, 4096))

        metric_bag = MetricBag(CPU)

        unit.prepare_metric_bag(metric_bag)

        for batches in reader:
            for batch in batches:
                unit.process_batch(batch, metric_bag)

        assert float(metric_bag.get("accuracy", Mean).compute()) == 2 / 3

        assert int(metric_bag.get("num_correct", Sum).compute()) == 2

        records = sorted((json.loads(line) for line in stream.getvalue().splitlines()), key=lambda r: r["id"])

        assert [(r["id"], r["answer"], r["reference_answer"], r["correct"]) for r in records] == [
            ("a", "1234", "1234", True),
            ("b", "7", "-7", False),
            ("c", "3.5", "3.5", True),
        ]

        assert records[1]["generation"] == _GENERATIONS[1]

        # The response ends at `<|endoftext|>`, as transformers stops there.
        assert records[0]["generation"] == "So the total is 1234.\n#### 1234"

        assert records[0]["question"] == _EXAMPLES[0]["prompt"]


class TestMtpAcceptanceInEvaluation:
    def test_measures_the_drafts_the_greedy_generations_accept(self, tokenizer: Qwen35Tokenizer) -> None:
        from fairseq2.generation.sampling import SamplingSequenceGenerator, TopKSampler

        from qwen35_fs2.models.qwen35 import create_qwen35_model
        from qwen35_fs2.models.qwen35.config import ENDOFTEXT_IDX, tiny_qwen35_config

        torch.manual_seed(0)

        config = tiny_qwen35_config()

        config.vocab_size = 248_320
        config.pad_idx = ENDOFTEXT_IDX
        config.mtp_num_layers = 1
        config.tied_embeddings = False

        model = create_qwen35_model(config).eval()

        # Four tokens dominate the output projection, so that drafts and
        # generated tokens agree at some positions and not at others.
        with torch.no_grad():
            final_proj = model.final_proj.weight

            final_proj[1000:1004] = torch.randn(4, final_proj.size(1), generator=torch.Generator().manual_seed(1))

        generator = SamplingSequenceGenerator(model, tokenizer.vocab_info, TopKSampler(k=1), max_gen_len=24, temperature=1.0)

        reader = create_prompt_reader(_EXAMPLES, tokenizer, create_fake_gangs(CPU), batch_size=3, prefetch=0)

        budget = ResponseBudget(24, 4096)

        unit = Gsm8kEvalUnit(generator, tokenizer, None, budget=budget)

        metric_bag = MetricBag(CPU)

        unit.prepare_metric_bag(metric_bag)

        batches = [batch for read in reader for batch in read]

        accepted, counted = 0, 0

        with torch.no_grad():
            for batch in batches:
                unit.process_batch(batch, metric_bag)

                # Independently, example by example: the head's draft at t (from
                # the trunk at t and token t + 1) against the trunk's greedy
                # token at t + 1, for each response token after the first.
                seqs, layout = batch.as_input()

                output = generator(seqs, layout)

                for row, (prompt_len, hypotheses) in enumerate(zip(layout.seq_lens, output.hypotheses)):
                    # The response as the unit cuts it (no end token here).
                    response = hypotheses[0].seq[: budget.for_prompt(prompt_len)]

                    full = torch.cat([seqs[row, :prompt_len], response])

                    inputs = full[:-1].unsqueeze(0)

                    inputs_layout = BatchLayout.of(inputs)

                    greedy = model(inputs, inputs_layout).argmax(-1)[0]

                    hidden = model.decoder(*model.decoder_frontend(inputs, inputs_layout))

                    drafts = model.final_proj(model.mtp(hidden, model.decoder_frontend.embed(full[1:].unsqueeze(0)), inputs_layout)).argmax(-1)[0]

                    for t in range(prompt_len - 1, full.size(0) - 2):
                        counted += 1

                        accepted += int(drafts[t] == greedy[t + 1])

        assert 0 < accepted < counted, (accepted, counted)

        assert float(metric_bag.get("mtp_acceptance", Mean).compute()) == accepted / counted


class TestResponseBudget:
    @pytest.mark.parametrize(
        ("budget", "prompt_len", "expected"),
        [
            # fairseq2 forces the end token at the last of `max_gen_len`.
            (ResponseBudget(8, 4096), 3, 7),
            (ResponseBudget(8, 4096), 300, 7),
            # `max_seq_len` caps prompt and response together.
            (ResponseBudget(8, 20), 15, 4),
            (ResponseBudget(8, 20), 20, 0),
            # fairseq2's decoder-only generators take `b` of `(a, b)`.
            (ResponseBudget((1.5, 8), 4096), 10, 7),
        ],
    )
    def test_is_what_the_prompt_gets_as_the_longest_of_its_batch(self, budget: ResponseBudget, prompt_len: int, expected: int) -> None:
        assert budget.for_prompt(prompt_len) == expected

    @pytest.mark.parametrize("name", ["sampling", "beam_search"])
    def test_of_a_generator_config_takes_b_of_a_b_as_fairseq2s_generators(self, name: str) -> None:
        from types import SimpleNamespace

        from fairseq2.recipe.config import BeamSearchConfig, SamplingConfig, SequenceGeneratorSection

        config = SamplingConfig(max_gen_len=(1.0, 128), max_seq_len=300) if name == "sampling" else BeamSearchConfig(max_gen_len=(1.0, 128), max_seq_len=300)

        budget = ResponseBudget.of(SequenceGeneratorSection(name=name, config=config), SimpleNamespace(max_seq_len=4096))  # type: ignore[arg-type]

        assert budget.for_prompt(100) == 127

        # `max_seq_len` of the config caps the model's.
        assert budget.for_prompt(250) == 49

    @pytest.mark.parametrize("ends_early", [False, True])
    def test_a_response_is_the_same_whatever_the_prompts_beside_it(self, tokenizer: Qwen35Tokenizer, ends_early: bool) -> None:
        from fairseq2.data import Collater
        from fairseq2.datasets import SequenceBatch
        from fairseq2.generation.sampling import SamplingSequenceGenerator, TopKSampler

        from qwen35_fs2.models.qwen35 import create_qwen35_model
        from qwen35_fs2.models.qwen35.config import ENDOFTEXT_IDX, tiny_qwen35_config

        torch.manual_seed(0)

        config = tiny_qwen35_config()

        config.vocab_size = 248_320
        config.pad_idx = ENDOFTEXT_IDX
        config.tied_embeddings = False

        model = create_qwen35_model(config).eval()

        examples = [
            {"id": "short", "prompt": "Hi?", "response": "#### 1"},
            {"id": "long", "prompt": "What is " + " + ".join(map(str, range(40))) + "?", "response": "#### 780"},
        ]

        encoder = ChatEncoder(tokenizer)

        prompts = [encoder.encode_prompt(example["prompt"]) for example in examples]

        if ends_early:
            # The short prompt's second greedy token made `<|im_end|>` (the
            # rows of the two tokens swapped in the output projection): its
            # response ends there when it is generated alone. fairseq2
            # forbids the end token in a batch until its longest prompt is
            # read, so batched with the long prompt it would run on.
            with torch.no_grad():
                seqs = prompts[0].unsqueeze(0)

                first = model(seqs, BatchLayout.of(seqs))[0, -1].argmax().view(1, 1)

                seqs = torch.cat([seqs, first], dim=1)

                second = int(model(seqs, BatchLayout.of(seqs))[0, -1].argmax())

                final_proj = model.final_proj.weight

                end = tokenizer.vocab_info.eos_idx

                final_proj[[second, end]] = final_proj[[end, second]]

        # Otherwise a random model writes no end token: every response runs
        # out, and fairseq2 gives the short prompt the long one's allowance
        # in a batch (8 tokens more than its own).
        generator = SamplingSequenceGenerator(model, tokenizer.vocab_info, TopKSampler(k=1), max_gen_len=8, temperature=1.0)

        def records(batches: list[SequenceBatch]) -> list[dict[str, object]]:
            stream = io.StringIO()

            unit = Gsm8kEvalUnit(generator, tokenizer, stream, budget=ResponseBudget(8, 4096))

            metric_bag = MetricBag(CPU)

            unit.prepare_metric_bag(metric_bag)

            with torch.no_grad():
                for batch in batches:
                    unit.process_batch(batch, metric_bag)

            records = sorted((json.loads(line) for line in stream.getvalue().splitlines()), key=lambda r: r["id"])

            assert int(metric_bag.get("num_truncated", Sum).compute()) == sum(bool(r["truncated"]) for r in records)

            return records

        def read(batch_size: int) -> list[SequenceBatch]:
            reader = create_prompt_reader(examples, tokenizer, create_fake_gangs(CPU), batch_size=batch_size, prefetch=0)

            return [batch for batches in reader for batch in batches]

        # Both prompts in one right-padded batch, as a reader of mixed
        # lengths would make it.
        collated = Collater(pad_value=tokenizer.vocab_info.pad_idx)([{**e, "indices": p} for e, p in zip(examples, prompts)])

        indices = collated.pop("indices")

        mixed = SequenceBatch(indices["seqs"], indices["seq_lens"], example=collated)

        alone = records(read(batch_size=1))

        assert records(read(batch_size=2)) == alone

        assert records([mixed]) == alone

        short = alone[1]

        assert short["id"] == "short"

        if ends_early:
            assert short["truncated"] is False

            assert short["generation"] == tokenizer.create_decoder(skip_special_tokens=True)(first.view(-1))
        else:
            assert all(record["truncated"] is True for record in alone)

    def test_each_rank_batches_its_prompts_by_length_longest_first(self, tokenizer: Qwen35Tokenizer) -> None:
        encoder = ChatEncoder(tokenizer)

        examples = [{"id": str(idx), "prompt": "What is " + "1 + " * n + "1?", "response": ""} for idx, n in enumerate([3, 1, 3, 2, 3, 1])]

        lengths = {e["id"]: len(encoder.encode_prompt(e["prompt"])) for e in examples}

        assert len(set(lengths.values())) == 3

        def batches(rank: int, size: int) -> list[list[str]]:
            from fairseq2.gang import FakeGang, Gangs

            gang = FakeGang(CPU, rank=rank, size=size)

            single = FakeGang(CPU)

            gangs = Gangs(root=gang, dp=gang, rdp=gang, sdp=single, tp=single, pp=single)

            reader = create_prompt_reader(examples, tokenizer, gangs, batch_size=2, prefetch=0)

            return [list(batch.example["id"]) for batches in reader for batch in batches]  # type: ignore[index]

        # Of one length each, in the order of the examples within a length.
        assert batches(0, 1) == [["0", "2"], ["4"], ["3"], ["1", "5"]]

        # Each rank batches its share: every other example.
        assert batches(0, 2) == [["0", "2"], ["4"]]
        assert batches(1, 2) == [["3"], ["1", "5"]]


class TestStopTokens:
    def test_responses_end_at_im_end_and_endoftext_whatever_the_eos(self, tokenizer: Qwen35Tokenizer) -> None:
        # The released generation config's `eos_token_id`.
        assert get_stop_indices(tokenizer) == {248_046, 248_044}

        documents = load_qwen35_tokenizer(get_qwen35_tokenizer_dir(), Qwen35TokenizerConfig(eos_token="<|endoftext|>", pad_token=GENERATION_PAD_TOKEN))

        assert get_stop_indices(documents) == {248_046, 248_044}

    def test_a_pad_token_that_ends_responses_is_a_clear_error(self, tokenizer: Qwen35Tokenizer) -> None:
        # The generators never choose the pad token: with `<|endoftext|>` as
        # pad, a model could not end a response with it.
        with pytest.raises(RecipeError, match=r"The tokenizer's pad token must not be a token that ends responses \(248044, 248046\), since the generator never chooses the pad token, but is 248044 instead\."):
            check_generation_pad(tokenizer)

        check_generation_pad(load_qwen35_tokenizer(get_qwen35_tokenizer_dir(), Qwen35TokenizerConfig(pad_token=GENERATION_PAD_TOKEN)))
