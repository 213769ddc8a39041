from __future__ import annotations

import ast
import json
import operator
import re
from fractions import Fraction
from pathlib import Path

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest

from qwen35_fs2.datasets.gsm8k import (
    GSM8K_PROMPT_TEMPLATE,
    Gsm8kExample,
    convert_gsm8k_to_sft_jsonl,
    extract_gsm8k_answer,
    gsm8k_split_path,
    read_gsm8k_parquet,
    write_sft_jsonl,
)
from qwen35_fs2.datasets.parquet import ParquetTextError
from qwen35_fs2.datasets.synthetic import (
    generate_synthetic_gsm8k,
    write_synthetic_gsm8k,
)

# The extraction used by verl and oumi, written out here on purpose.
STANDARD_ANSWER_REGEX = re.compile(r"#### (\-?[0-9\.\,]+)")

ANNOTATION = re.compile(r"<<([^=<>]+)=([^<>]+)>>")

NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")

# Small factors that GSM8K writes as words ("half", "a third", "three tests").
WORD_NUMBERS = {Fraction(2), Fraction(3), Fraction(4)}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}  # fmt: skip


def _eval(expr: str) -> Fraction:
    def visit(node: ast.expr) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](visit(node.left), visit(node.right))  # type: ignore[no-any-return]

        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -visit(node.operand)

        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return Fraction(str(node.value))

        raise AssertionError(f"Unexpected expression {expr!r}.")

    return visit(ast.parse(expr, mode="eval").body)


def _numbers(text: str) -> set[Fraction]:
    return {Fraction(n.replace(",", "")) for n in NUMBER.findall(text)}


@pytest.fixture(scope="module")
def synthetic_examples() -> list[Gsm8kExample]:
    return generate_synthetic_gsm8k(400, seed=11)


class TestSyntheticGsm8k:
    def test_every_solution_is_arithmetically_correct(
        self, synthetic_examples: list[Gsm8kExample]
    ) -> None:
        for example in synthetic_examples:
            *steps, final = example.answer.split("\n")

            assert steps, example.answer

            known = _numbers(example.question) | WORD_NUMBERS

            result = None

            for step in steps:
                annotations = ANNOTATION.findall(step)

                assert len(annotations) == 1, step

                expr, written = annotations[0]

                # As in GSM8K: `48/2 = <<48/2=24>>24`.
                assert f"{expr} = <<{expr}={written}>>{written}" in step

                result = Fraction(written)

                assert _eval(expr) == result, step

                # Every operand comes from the question or an earlier step.
                operands = {Fraction(n) for n in re.findall(r"\d+(?:\.\d+)?", expr)}

                assert operands <= known | {abs(k) for k in known}, (step, example.question)  # fmt: skip

                known.add(result)

            match = STANDARD_ANSWER_REGEX.fullmatch(final)

            assert match is not None, final

            assert Fraction(match[1].replace(",", "")) == result

            assert extract_gsm8k_answer(example.answer) == match[1].replace(",", "")

    def test_answers_include_thousands_negatives_and_decimals(
        self, synthetic_examples: list[Gsm8kExample]
    ) -> None:
        answers = [STANDARD_ANSWER_REGEX.search(e.answer)[1] for e in synthetic_examples]  # type: ignore[index]

        with_separators = [a for a in answers if "," in a]

        assert with_separators
        assert [a for a in answers if a.startswith("-")]
        assert [a for a in answers if "." in a]

        for answer in answers:
            # Separators exactly where they belong, and only above 999.
            assert re.fullmatch(r"-?\d{1,3}(,\d{3})*(\.\d+)?", answer), answer

            assert ("," in answer) == (abs(Fraction(answer.replace(",", ""))) >= 1000)

    def test_generation_is_deterministic_and_questions_are_distinct(self) -> None:
        first = generate_synthetic_gsm8k(200, seed=1)

        assert first == generate_synthetic_gsm8k(200, seed=1)
        assert first != generate_synthetic_gsm8k(200, seed=2)

        assert len({e.question for e in first}) == 200

    def test_write_synthetic_gsm8k_lays_out_files_as_openai_gsm8k(
        self, tmp_path: Path
    ) -> None:
        train, test = write_synthetic_gsm8k(tmp_path, num_train=50, num_test=20, seed=0)

        assert train == tmp_path.joinpath("main", "train-00000-of-00001.parquet")
        assert test == tmp_path.joinpath("main", "test-00000-of-00001.parquet")

        for path, num_rows in ((train, 50), (test, 20)):
            table = pq.read_table(path)

            assert table.schema == pa.schema([("question", pa.string()), ("answer", pa.string())])  # fmt: skip
            assert table.num_rows == num_rows

        train_questions = set(pq.read_table(train).column("question").to_pylist())
        test_questions = set(pq.read_table(test).column("question").to_pylist())

        assert not train_questions & test_questions


class TestGsm8kFiles:
    def test_extract_gsm8k_answer_strips_separators(self) -> None:
        assert extract_gsm8k_answer("a\nb = <<1+1=2>>2\n#### 1,234") == "1234"
        assert extract_gsm8k_answer("#### -3") == "-3"
        assert extract_gsm8k_answer("#### 0.5") == "0.5"
        assert extract_gsm8k_answer("no number at all") is None

    def test_read_gsm8k_parquet_round_trips_examples(self, tmp_path: Path) -> None:
        path = gsm8k_split_path(tmp_path, "train")

        write_synthetic_gsm8k(tmp_path, num_train=5, num_test=0, seed=3)

        examples = read_gsm8k_parquet(path)

        assert examples == generate_synthetic_gsm8k(5, seed=3)

    def test_read_gsm8k_parquet_raises_error_on_missing_column(self, tmp_path: Path) -> None:  # fmt: skip
        path = tmp_path.joinpath("a.parquet")

        pq.write_table(pa.table({"question": ["q"]}), path)

        with pytest.raises(ParquetTextError, match="must be a parquet file with `question` and `answer` columns"):  # fmt: skip
            read_gsm8k_parquet(path)

    def test_read_gsm8k_parquet_raises_error_on_null_answer(self, tmp_path: Path) -> None:  # fmt: skip
        path = tmp_path.joinpath("a.parquet")

        pq.write_table(pa.table({"question": ["q1", "q2"], "answer": ["#### 1", None]}), path)  # fmt: skip

        with pytest.raises(ParquetTextError, match=r"Row 1 of .* must have a string `question` and `answer`, but has 'q2' and None instead"):  # fmt: skip
            read_gsm8k_parquet(path)

    def test_write_sft_jsonl_writes_fairseq2_src_tgt_lines(
        self, tmp_path: Path
    ) -> None:
        examples = [Gsm8kExample("What is 1+1?", "1+1 = <<1+1=2>>2\n#### 2"), Gsm8kExample("Q2 \"é\"", "#### 3")]  # fmt: skip

        path = tmp_path.joinpath("sft", "train.jsonl")

        assert write_sft_jsonl(examples, path) == 2

        lines = [
            json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
        ]

        assert lines == [
            {"src": "Question: What is 1+1?\nAnswer:\n", "tgt": "1+1 = <<1+1=2>>2\n#### 2"},  # fmt: skip
            {"src": 'Question: Q2 "é"\nAnswer:\n', "tgt": "#### 3"},
        ]

        write_sft_jsonl(examples[:1], path, prompt_template="{question}")

        assert json.loads(path.read_text())["src"] == "What is 1+1?"

    def test_write_sft_jsonl_raises_error_without_question_placeholder(
        self, tmp_path: Path
    ) -> None:
        with pytest.raises(ValueError, match="`prompt_template` must contain {question}"):  # fmt: skip
            write_sft_jsonl([], tmp_path.joinpath("a.jsonl"), prompt_template="Q:")

    def test_convert_gsm8k_to_sft_jsonl_writes_a_directory_per_split(
        self, tmp_path: Path
    ) -> None:
        write_synthetic_gsm8k(tmp_path.joinpath("gsm8k"), num_train=7, num_test=3, seed=0)  # fmt: skip

        outputs = convert_gsm8k_to_sft_jsonl(tmp_path.joinpath("gsm8k"), tmp_path.joinpath("sft"))  # fmt: skip

        assert outputs == {
            "train": tmp_path.joinpath("sft", "train", "train.jsonl"),
            "test": tmp_path.joinpath("sft", "test", "test.jsonl"),
        }

        train = [json.loads(line) for line in outputs["train"].read_text().splitlines()]
        test = [json.loads(line) for line in outputs["test"].read_text().splitlines()]

        examples = generate_synthetic_gsm8k(10, seed=0)

        assert [line["tgt"] for line in train + test] == [e.answer for e in examples]
        assert train[0]["src"] == GSM8K_PROMPT_TEMPLATE.format(question=examples[0].question)  # fmt: skip
