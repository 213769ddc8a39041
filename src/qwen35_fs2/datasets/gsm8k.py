"""GSM8K in the layout of the ``openai/gsm8k`` Hugging Face repository, and its
conversion to fairseq2's SFT format.

``openai/gsm8k`` holds ``main/train-00000-of-00001.parquet`` and
``main/test-00000-of-00001.parquet`` with string columns ``question`` and
``answer``. An answer is a series of step lines with calculator annotations
(``Natalia sold 48/2 = <<48/2=24>>24 clips in May.``) and a final line
``#### 72``. fairseq2's ``lm/sft`` recipe reads JSONL lines ``{"src": ...,
"tgt": ...}`` from ``<path>/<split>/**/*.jsonl``, and trains on ``tgt`` only.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, final

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from qwen35_fs2.datasets.parquet import ParquetTextError

GSM8K_PROMPT_TEMPLATE: Final = "Question: {question}\nAnswer:\n"
"""
The default ``src`` of an SFT example; the target, the GSM8K answer, follows
it directly, so it ends on a line break. Use ``"{question}"`` with the SFT
recipe's ``chat_mode``, where the chat template separates the turns.
"""

GSM8K_SPLITS: Final = ("train", "test")


@final
@dataclass(frozen=True)
class Gsm8kExample:
    question: str
    answer: str
    """The worked solution, ending with a ``#### <number>`` line."""


FINAL_ANSWER_MARKER: Final = "####"

# A number with optional thousands separators and decimals, after an
# optional currency sign, after an optional minus sign that touches it and
# follows no word character or dash: the `-` of a Markdown bullet (`- 72`),
# of a rule (`---` above `72`) or of a range (`3-18`) is no sign.
# Thousands separators count only before a group of exactly three digits:
# `1,2345` is no 1,234 and 5.
_NUMBER: Final = (
    r"(?:(?<![\w\-\u2212])(?P<sign>[-\u2212]))?(?:\$[ \t]*)?"
    r"(?P<number>\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)

_NUMBER_RE: Final = re.compile(_NUMBER)

# The final answer of GSM8K: the marker, then the number. Not a Markdown
# heading (`#### Step 2: add`, `##### Note: 3 items`), which a chat model's
# free-form answer may hold: no word after the marker, no fifth `#`.
_FINAL_ANSWER_RE: Final = re.compile(rf"(?<!#){FINAL_ANSWER_MARKER}(?!#)[ \t]*{_NUMBER}")


def extract_gsm8k_answer(text: str) -> str | None:
    """Returns the final number of a GSM8K-style solution (or of a model's
    completion) in a canonical form, so ``1,234``, ``1234`` and ``1234.00``
    compare equal.

    The number is the one right after the last ``####`` marker followed by
    a number; without such a marker, the last number of ``text``. Returns
    ``None`` if there is none.
    """
    match = None

    for match in _FINAL_ANSWER_RE.finditer(text):
        pass

    if match is None:
        for match in _NUMBER_RE.finditer(text):
            pass

    if match is None:
        return None

    return _canonicalize(match["sign"], match["number"])


def _canonicalize(sign: str | None, number: str) -> str | None:
    try:
        value = Decimal(number.replace(",", ""))
    except InvalidOperation:
        return None

    if value == 0:
        return "0"

    if sign:
        value = -value

    # `normalize` strips trailing zeros; the `f` format avoids exponents.
    return format(value.normalize(), "f")


def gsm8k_split_path(gsm8k_dir: Path, split: str) -> Path:
    """Returns the parquet file of ``split`` in a directory laid out as
    ``openai/gsm8k``."""
    return gsm8k_dir.joinpath("main", f"{split}-00000-of-00001.parquet")


def read_gsm8k_parquet(path: Path) -> list[Gsm8kExample]:
    """Reads a GSM8K parquet file, such as :func:`gsm8k_split_path`."""
    try:
        table = pq.read_table(path, columns=["question", "answer"])
    except FileNotFoundError:
        raise
    except (OSError, pa.ArrowException, KeyError) as ex:
        raise ParquetTextError(
            f"{path} must be a parquet file with `question` and `answer` columns, but is not."
        ) from ex

    questions = table.column("question").to_pylist()
    answers = table.column("answer").to_pylist()

    examples = []

    for idx, (question, answer) in enumerate(zip(questions, answers, strict=True)):
        if not isinstance(question, str) or not isinstance(answer, str):
            raise ParquetTextError(
                f"Row {idx} of {path} must have a string `question` and `answer`, but has {question!r} and {answer!r} instead."
            )

        examples.append(Gsm8kExample(question, answer))

    return examples


def write_gsm8k_parquet(examples: Iterable[Gsm8kExample], path: Path) -> None:
    """Writes ``examples`` with the schema of ``openai/gsm8k``."""
    examples = list(examples)

    table = pa.table(
        {
            "question": pa.array([e.question for e in examples], pa.string()),
            "answer": pa.array([e.answer for e in examples], pa.string()),
        }
    )

    path.parent.mkdir(parents=True, exist_ok=True)

    pq.write_table(table, path)


def write_sft_jsonl(
    examples: Iterable[Gsm8kExample],
    path: Path,
    *,
    prompt_template: str = GSM8K_PROMPT_TEMPLATE,
) -> int:
    """Writes ``examples`` as fairseq2 SFT lines ``{"src": <prompt>, "tgt":
    <answer>}``, the prompt being ``prompt_template`` formatted with the
    question.

    :returns: The number of lines written.
    """
    if "{question}" not in prompt_template:
        raise ValueError(f"`prompt_template` must contain {{question}}, but is {prompt_template!r} instead.")  # fmt: skip

    path.parent.mkdir(parents=True, exist_ok=True)

    num_lines = 0

    with path.open("w", encoding="utf-8") as fp:
        for example in examples:
            src = prompt_template.format(question=example.question)

            fp.write(
                json.dumps({"src": src, "tgt": example.answer}, ensure_ascii=False)
            )
            fp.write("\n")

            num_lines += 1

    return num_lines


def convert_gsm8k_to_sft_jsonl(
    gsm8k_dir: Path,
    output_dir: Path,
    *,
    prompt_template: str = GSM8K_PROMPT_TEMPLATE,
) -> dict[str, Path]:
    """Converts the splits of a GSM8K directory laid out as ``openai/gsm8k``
    (the real one or :func:`~qwen35_fs2.datasets.synthetic.write_synthetic_gsm8k`'s)
    to ``output_dir/<split>/<split>.jsonl``, the layout the fairseq2 SFT recipe
    reads with ``{path: output_dir, split: <split>}``.

    :returns: The JSONL file of each split.
    """
    outputs = {}

    for split in GSM8K_SPLITS:
        examples = read_gsm8k_parquet(gsm8k_split_path(gsm8k_dir, split))

        output = output_dir.joinpath(split, f"{split}.jsonl")

        write_sft_jsonl(examples, output, prompt_template=prompt_template)

        outputs[split] = output

    return outputs
