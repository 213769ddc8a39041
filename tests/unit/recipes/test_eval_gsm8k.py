from __future__ import annotations

import io
import json
from unittest.mock import Mock

import torch
from torch import Tensor

from fairseq2.gang import create_fake_gangs
from fairseq2.generation import GenerationCounters, Hypothesis, SequenceGenerator, SequenceGeneratorOutput
from fairseq2.metrics import Mean, MetricBag, Sum
from fairseq2.nn import BatchLayout

from qwen35_fs2.models.qwen35.tokenizer import Qwen35Tokenizer
from qwen35_fs2.recipes.eval_gsm8k import Gsm8kEvalUnit
from qwen35_fs2.recipes.generation import create_prompt_reader
from qwen35_fs2.recipes.instruction import ChatEncoder

CPU = torch.device("cpu")

_EXAMPLES = [
    {"id": "a", "prompt": "What is 1,000 + 234?", "response": "1000 + 234 = <<1000+234=1234>>1234\n#### 1,234"},
    {"id": "b", "prompt": "What is 3 - 10?", "response": "3 - 10 = <<3-10=-7>>-7\n#### -7"},
    {"id": "c", "prompt": "Half of 7?", "response": "7 / 2 = <<7/2=3.5>>3.5\n#### 3.5"},
]

# The model's answers: right in another notation, wrong, right without a marker.
_GENERATIONS = ["So the total is 1234.\n#### 1234", "It is 7.\n#### 7", "Half of 7 is 3.50 apples."]


def _fake_generator(tokenizer: Qwen35Tokenizer, prompts: list[Tensor]) -> SequenceGenerator:
    encoder = tokenizer.create_encoder(mode="prompt_response")

    def generate(seqs: Tensor, seqs_layout: BatchLayout) -> SequenceGeneratorOutput:
        # The prompts arrive as rendered by the chat template, right-padded.
        for row, prompt in enumerate(prompts):
            torch.testing.assert_close(seqs[row, : len(prompt)], prompt)

        hypotheses = [[Hypothesis(encoder(text), score=None, step_scores=None)] for text in _GENERATIONS]

        return SequenceGeneratorOutput(hypotheses, GenerationCounters(num_generated_elements=30, generation_time=0.5))

    return Mock(spec=SequenceGenerator, side_effect=generate)


class TestGsm8kEvalUnit:
    def test_scores_final_answers_and_writes_every_generation(self, tokenizer: Qwen35Tokenizer) -> None:
        reader = create_prompt_reader(_EXAMPLES, tokenizer, create_fake_gangs(CPU), batch_size=3, prefetch=0)

        [batch] = next(reader)

        encoder = ChatEncoder(tokenizer)

        generator = _fake_generator(tokenizer, [encoder.encode_prompt(e["prompt"]) for e in _EXAMPLES])

        stream = io.StringIO()

        unit = Gsm8kEvalUnit(generator, tokenizer, stream)

        metric_bag = MetricBag(CPU)

        unit.prepare_metric_bag(metric_bag)

        unit.process_batch(batch, metric_bag)

        assert float(metric_bag.get("accuracy", Mean).compute()) == 2 / 3

        assert int(metric_bag.get("num_correct", Sum).compute()) == 2

        records = [json.loads(line) for line in stream.getvalue().splitlines()]

        assert [(r["id"], r["answer"], r["reference_answer"], r["correct"]) for r in records] == [
            ("a", "1234", "1234", True),
            ("b", "7", "-7", False),
            ("c", "3.5", "3.5", True),
        ]

        assert records[1]["generation"] == _GENERATIONS[1]

        assert records[0]["question"] == _EXAMPLES[0]["prompt"]
