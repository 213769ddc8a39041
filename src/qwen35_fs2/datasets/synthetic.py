"""Synthetic corpora in the real file formats, for tests and ``make demo``:
no downloads, deterministic in their seed.

- :func:`write_synthetic_fineweb` writes FineWeb-Edu-shaped parquet shards of
  English-like educational text of varied lengths.
- :func:`write_synthetic_gsm8k` writes templated arithmetic word problems in
  the ``openai/gsm8k`` layout and answer format. The arithmetic is exact
  (:class:`~decimal.Decimal`), so the answers are correct and a tiny model can
  learn the templates in minutes on CPU.
"""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Final, final

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from qwen35_fs2.datasets.gsm8k import (
    Gsm8kExample,
    gsm8k_split_path,
    write_gsm8k_parquet,
)

FINEWEB_SCHEMA: Final = pa.schema(
    [
        ("text", pa.string()),
        ("id", pa.string()),
        ("dump", pa.string()),
        ("url", pa.string()),
        ("file_path", pa.string()),
        ("language", pa.string()),
        ("language_score", pa.float64()),
        ("token_count", pa.int64()),
        ("score", pa.float64()),
        ("int_score", pa.int64()),
    ]
)
"""The columns of ``HuggingFaceFW/fineweb-edu`` shards."""

# fmt: off
_TOPICS: Final = {
    "photosynthesis": (
        "plants turn light energy into chemical energy stored in sugar",
        "chlorophyll absorbs mostly red and blue light",
        "the process takes in carbon dioxide and releases oxygen",
        "most photosynthesis happens in the leaves",
    ),
    "the water cycle": (
        "water evaporates from oceans, lakes and rivers",
        "water vapour cools and condenses into clouds",
        "precipitation returns water to the surface as rain or snow",
        "groundwater slowly flows back towards the sea",
    ),
    "fractions": (
        "a fraction describes a part of a whole",
        "the denominator tells how many equal parts there are",
        "equivalent fractions name the same amount",
        "to add fractions, the denominators must match",
    ),
    "volcanoes": (
        "magma rises through cracks in the crust",
        "lava that cools quickly forms fine-grained rock",
        "many volcanoes sit along the edges of tectonic plates",
        "ash from large eruptions can cool the climate for years",
    ),
    "the Roman Republic": (
        "citizens elected magistrates for terms of one year",
        "the senate advised the magistrates on laws and wars",
        "roads connected distant provinces to the city",
        "the republic gave way to an empire under Augustus",
    ),
    "the human heart": (
        "the heart has four chambers",
        "arteries carry blood away from the heart",
        "valves keep blood flowing in one direction",
        "regular exercise strengthens the heart muscle",
    ),
    "electric circuits": (
        "current flows only around a closed loop",
        "a resistor limits the flow of current",
        "in a series circuit the same current passes through every part",
        "switches open and close the path of the current",
    ),
    "ecosystems": (
        "producers make their own food from sunlight",
        "consumers depend on other organisms for energy",
        "decomposers return nutrients to the soil",
        "removing one species can affect the whole food web",
    ),
    "the solar system": (
        "eight planets orbit the sun",
        "the inner planets are small and rocky",
        "the outer planets are giants made mostly of gas and ice",
        "a year is the time a planet takes to orbit the sun once",
    ),
    "reading comprehension": (
        "good readers ask questions before, during and after reading",
        "the main idea is what the text is mostly about",
        "details support the main idea",
        "summarising helps readers remember what they read",
    ),
}

_SENTENCES: Final = (
    "In this lesson, we explore {topic}.",
    "One important idea is that {fact}.",
    "Scientists have shown that {fact}.",
    "Students often ask why {fact}.",
    "It is worth remembering that {fact}.",
    "For example, {fact}, which surprises many learners.",
    "A simple classroom activity shows that {fact}.",
    "Teachers can use a diagram to explain that {fact}.",
    "Historians and scientists alike agree that {fact}.",
    "Try to explain in your own words why {fact}.",
    "In short, {fact}.",
    "Research from {year} suggests that {fact}.",
    "About {percent} percent of students remember that {fact} after one week.",
    "Review question {number}: describe where {topic} matters in daily life.",
)

_OPENINGS: Final = (
    "Introduction to {Topic}",
    "Understanding {Topic}: A Guide for Students",
    "{Topic} Explained",
    "Lesson Plan: {Topic}",
    "Frequently Asked Questions About {Topic}",
)

_DUMPS: Final = ("CC-MAIN-2013-20", "CC-MAIN-2017-34", "CC-MAIN-2019-04", "CC-MAIN-2021-43", "CC-MAIN-2023-50", "CC-MAIN-2024-10")

_SITES: Final = ("www.example-school.org", "learn.example.edu", "kids.example-science.net", "www.example-museum.org", "openclass.example.com")
# fmt: on

# A rough count of GPT-2 tokens (the unit of FineWeb's `token_count`): words,
# numbers and punctuation marks.
_TOKEN_PATTERN: Final = re.compile(r"\w+|[^\w\s]")


def write_synthetic_fineweb(
    out_dir: Path,
    num_shards: int,
    docs_per_shard: int,
    seed: int,
    *,
    rows_per_row_group: int = 64,
) -> list[Path]:
    """Writes ``num_shards`` FineWeb-Edu-shaped parquet shards of
    ``docs_per_shard`` documents each, in row groups of ``rows_per_row_group``
    rows, as ``out_dir/sample/10BT/000_00000.parquet`` and so on.

    Documents range from one sentence to a few thousand words. ``token_count``
    approximates GPT-2 tokens; the other metadata is made up.

    :returns: The shards, in order.
    """
    if num_shards < 1:
        raise ValueError(f"`num_shards` must be greater than or equal to 1, but is {num_shards} instead.")  # fmt: skip

    if docs_per_shard < 1:
        raise ValueError(f"`docs_per_shard` must be greater than or equal to 1, but is {docs_per_shard} instead.")  # fmt: skip

    if rows_per_row_group < 1:
        raise ValueError(f"`rows_per_row_group` must be greater than or equal to 1, but is {rows_per_row_group} instead.")  # fmt: skip

    rng = random.Random(seed)

    shard_dir = out_dir.joinpath("sample", "10BT")

    shard_dir.mkdir(parents=True, exist_ok=True)

    files = []

    for shard_idx in range(num_shards):
        rows = [_synthetic_fineweb_row(rng) for _ in range(docs_per_shard)]

        table = pa.Table.from_pylist(rows, schema=FINEWEB_SCHEMA)

        file = shard_dir.joinpath(f"{shard_idx:03d}_00000.parquet")

        pq.write_table(table, file, row_group_size=rows_per_row_group)

        files.append(file)

    return files


def _synthetic_fineweb_row(rng: random.Random) -> dict[str, object]:
    topic = rng.choice(list(_TOPICS))

    text = _synthetic_document(rng, topic)

    dump = rng.choice(_DUMPS)

    segment = rng.randrange(10**12, 10**13)

    score = round(rng.uniform(2.5, 5.0), 6)

    topic_slug = topic.lower().replace(" ", "-")

    return {
        "text": text,
        "id": f"<urn:uuid:{uuid.UUID(int=rng.getrandbits(128), version=4)}>",
        "dump": dump,
        "url": f"https://{rng.choice(_SITES)}/{topic_slug}/{rng.randrange(1, 100_000)}",
        "file_path": f"s3://commoncrawl/crawl-data/{dump}/segments/{segment}.{rng.randrange(100)}/warc/{dump}-{rng.randrange(100_000):05d}.warc.gz",
        "language": "en",
        "language_score": round(rng.uniform(0.9, 1.0), 6),
        "token_count": len(_TOKEN_PATTERN.findall(text)),
        "score": score,
        "int_score": int(round(score)),
    }


def _synthetic_document(rng: random.Random, topic: str) -> str:
    # Mostly medium documents, some one-liners and a long tail, as in web text.
    kind = rng.random()
    if kind < 0.1:
        num_sentences = rng.randint(1, 3)
    elif kind < 0.75:
        num_sentences = rng.randint(4, 20)
    elif kind < 0.97:
        num_sentences = rng.randint(21, 80)
    else:
        num_sentences = rng.randint(81, 300)

    facts = _TOPICS[topic]

    paragraphs: list[str] = []

    if num_sentences > 3 and rng.random() < 0.5:
        opening = rng.choice(_OPENINGS)

        paragraphs.append(opening.format(Topic=topic[0].upper() + topic[1:]))

    sentences: list[str] = []

    for _ in range(num_sentences):
        template = rng.choice(_SENTENCES)

        sentence = template.format(
            topic=topic,
            fact=rng.choice(facts),
            year=rng.randint(1950, 2024),
            percent=rng.randint(5, 95),
            number=rng.randint(1, 20),
        )

        sentences.append(sentence[0].upper() + sentence[1:])

        if len(sentences) >= rng.randint(3, 7):
            paragraphs.append(" ".join(sentences))

            sentences = []

    if sentences:
        paragraphs.append(" ".join(sentences))

    return "\n\n".join(paragraphs)


def write_synthetic_gsm8k(
    out_dir: Path, num_train: int, num_test: int, seed: int
) -> tuple[Path, Path]:
    """Writes ``num_train`` and ``num_test`` distinct synthetic problems as
    ``out_dir/main/train-00000-of-00001.parquet`` and
    ``out_dir/main/test-00000-of-00001.parquet``, the layout of
    ``openai/gsm8k``.

    :returns: The train and test files.
    """
    if num_train < 0 or num_test < 0:
        raise ValueError(f"`num_train` and `num_test` must be non-negative, but are {num_train} and {num_test} instead.")  # fmt: skip

    examples = generate_synthetic_gsm8k(num_train + num_test, seed)

    train_path = gsm8k_split_path(out_dir, "train")
    test_path = gsm8k_split_path(out_dir, "test")

    write_gsm8k_parquet(examples[:num_train], train_path)
    write_gsm8k_parquet(examples[num_train:], test_path)

    return train_path, test_path


def generate_synthetic_gsm8k(num_examples: int, seed: int) -> list[Gsm8kExample]:
    """Returns ``num_examples`` distinct templated word problems with worked,
    calculator-annotated solutions. Some answers are above 1,000 (written with
    thousands separators), negative, or decimal."""
    rng = random.Random(seed)

    examples: list[Gsm8kExample] = []

    questions: set[str] = set()

    while len(examples) < num_examples:
        problem = rng.choice(_PROBLEMS)(rng)

        if problem.question in questions:
            continue

        questions.add(problem.question)

        examples.append(Gsm8kExample(problem.question, problem.render_answer()))

    return examples


@final
@dataclass(frozen=True)
class _Step:
    before: str
    expr: str
    after: str


@final
class _Problem:
    """A word problem whose solution is built step by step; each step computes
    its expression, so the written results cannot disagree with it."""

    def __init__(self, question: str) -> None:
        self.question = question

        self._lines: list[str] = []

        self._result: Decimal | None = None

    def step(self, before: str, expr: str, after: str) -> Decimal:
        result = _evaluate(expr)

        value = _format_number(result)

        self._lines.append(f"{before}{expr} = <<{expr}={value}>>{value}{after}")

        self._result = result

        return result

    def render_answer(self) -> str:
        if self._result is None:
            raise ValueError("The problem must have at least one step, but has none.")  # fmt: skip

        return "\n".join([*self._lines, f"#### {_format_answer(self._result)}"])


_EXPR_TOKEN: Final = re.compile(r"\d+(?:\.\d+)?|[-+*/()]")


def _evaluate(expr: str) -> Decimal:
    """Evaluates ``+ - * /`` and parentheses over decimals, exactly."""
    tokens = _EXPR_TOKEN.findall(expr)

    if "".join(tokens) != expr:
        raise ValueError(f"`expr` must be an arithmetic expression without spaces, but is {expr!r} instead.")  # fmt: skip

    pos = 0

    def parse_sum() -> Decimal:
        nonlocal pos

        value = parse_product()

        while pos < len(tokens) and tokens[pos] in "+-":
            op = tokens[pos]
            pos += 1

            rhs = parse_product()

            value = value + rhs if op == "+" else value - rhs

        return value

    def parse_product() -> Decimal:
        nonlocal pos

        value = parse_atom()

        while pos < len(tokens) and tokens[pos] in "*/":
            op = tokens[pos]
            pos += 1

            rhs = parse_atom()

            if op == "*":
                value = value * rhs
            else:
                quotient = value / rhs
                if quotient * rhs != value:
                    raise ValueError(f"`expr` must divide exactly, but {expr!r} does not.")  # fmt: skip

                value = quotient

        return value

    def parse_atom() -> Decimal:
        nonlocal pos

        token = tokens[pos]
        pos += 1

        if token == "-":
            return -parse_atom()

        if token == "(":
            value = parse_sum()
            pos += 1  # ")"

            return value

        return Decimal(token)

    value = parse_sum()

    if pos != len(tokens):
        raise ValueError(f"`expr` must be a well-formed expression, but is {expr!r} instead.")  # fmt: skip

    return value


def _format_number(value: Decimal) -> str:
    """Formats ``value`` as GSM8K's calculator does: no separators, no
    trailing zeros."""
    if value == value.to_integral_value():
        return str(int(value))

    return f"{value.normalize():f}"


def _format_answer(value: Decimal) -> str:
    if value == value.to_integral_value():
        return f"{int(value):,}"

    return f"{value.normalize():,f}"


def _money(value: Decimal) -> str:
    return f"${value:.2f}"


# fmt: off
_NAMES: Final = ("Natalia", "James", "Aisha", "Mateo", "Priya", "Liam", "Chen", "Fatima", "Olivia", "Kwame", "Sofia", "Noah")
_ITEMS: Final = ("clips", "stickers", "cupcakes", "books", "marbles", "pencils", "postcards", "bracelets")
_GOODS: Final = (("notebook", "notebooks"), ("sandwich", "sandwiches"), ("ticket", "tickets"), ("plant", "plants"), ("toy car", "toy cars"))
_PARTS: Final = ((2, "half"), (3, "a third"), (4, "a quarter"))
# fmt: on


def _half_as_many(rng: random.Random) -> _Problem:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    divisor, word = rng.choice(_PARTS)
    april = divisor * rng.randint(3, 40)

    problem = _Problem(
        f"{name} sold {april} {item} in April, and then sold {word} as many {item} in May. How many {item} did {name} sell altogether in April and May?"
    )

    may = problem.step(f"{name} sold ", f"{april}/{divisor}", f" {item} in May.")
    problem.step(f"{name} sold ", f"{april}+{may}", f" {item} altogether in April and May.")  # fmt: skip

    return problem


def _shopping_change(rng: random.Random) -> _Problem:
    name = rng.choice(_NAMES)
    good, goods = rng.choice(_GOODS)
    count = rng.randint(2, 9)
    price = Decimal(rng.randint(1, 12)) + Decimal(rng.choice((0, 25, 50, 75))) / 100
    bill = next(b for b in (20, 50, 100, 200) if b >= count * price)

    problem = _Problem(
        f"{name} buys {count} {goods} that cost {_money(price)} per {good}. {name} pays with a ${bill} bill. How much change, in dollars, does {name} get back?"
    )

    cost = problem.step(f"The {goods} cost ", f"{count}*{_format_number(price)}", " dollars.")  # fmt: skip
    problem.step(f"{name} gets back ", f"{bill}-{_format_number(cost)}", " dollars in change.")  # fmt: skip

    return problem


def _temperature(rng: random.Random) -> _Problem:
    start = rng.randint(-6, 12)
    drop = rng.randint(4, 25)
    rise = rng.randint(1, 10)

    problem = _Problem(
        f"At midnight the temperature was {start} degrees. By dawn it had dropped by {drop} degrees, and by noon it had risen by {rise} degrees. What was the temperature at noon, in degrees?"
    )

    dawn = problem.step("At dawn the temperature was ", f"{start}-{drop}", " degrees.")
    problem.step("At noon the temperature was ", f"{_format_number(dawn)}+{rise}", " degrees.")  # fmt: skip

    return problem


def _factory(rng: random.Random) -> _Problem:
    per_day = rng.randint(120, 980)
    days = rng.randint(6, 30)
    shipped = rng.randint(1, per_day * days // 2)
    item = rng.choice(("bolts", "bottles", "chairs", "bricks"))

    problem = _Problem(
        f"A factory makes {per_day} {item} every day. After {days} days, it ships {shipped} of the {item} to a store. How many {item} are left at the factory?"
    )

    made = problem.step("The factory makes ", f"{per_day}*{days}", f" {item} in {days} days.")  # fmt: skip
    problem.step("There are ", f"{_format_number(made)}-{shipped}", f" {item} left.")

    return problem


def _savings(rng: random.Random) -> _Problem:
    name = rng.choice(_NAMES)
    weekly = rng.randint(5, 60)
    weeks = rng.randint(4, 52)
    spent = rng.randint(1, weekly * weeks)

    problem = _Problem(
        f"{name} saves ${weekly} every week for {weeks} weeks. Then {name} spends ${spent} on a bicycle. How many dollars does {name} have left?"
    )

    saved = problem.step(f"{name} saves ", f"{weekly}*{weeks}", " dollars.")
    problem.step(f"{name} has ", f"{_format_number(saved)}-{spent}", " dollars left.")

    return problem


def _sharing(rng: random.Random) -> _Problem:
    friends = rng.randint(2, 12)
    each = rng.randint(3, 15)
    eaten = rng.randint(1, each - 1)
    item = rng.choice(("cookies", "grapes", "crackers", "strawberries"))

    problem = _Problem(
        f"{friends} friends share {friends * each} {item} equally. Each friend eats {eaten} of their {item}. How many {item} does each friend have left?"
    )

    share = problem.step(
        "Each friend gets ", f"{friends * each}/{friends}", f" {item}."
    )
    problem.step("Each friend has ", f"{_format_number(share)}-{eaten}", f" {item} left.")  # fmt: skip

    return problem


def _distance(rng: random.Random) -> _Problem:
    name = rng.choice(_NAMES)
    speed = rng.randint(20, 70)
    first, second = rng.randint(1, 5), rng.randint(1, 5)

    problem = _Problem(
        f"{name} drives at {speed} miles per hour for {first} hours, takes a break, and then drives {second} more hours at the same speed. How many miles does {name} drive in total?"
    )

    before = problem.step(f"Before the break, {name} drives ", f"{speed}*{first}", " miles.")  # fmt: skip
    after = problem.step(f"After the break, {name} drives ", f"{speed}*{second}", " miles.")  # fmt: skip
    problem.step(f"In total, {name} drives ", f"{_format_number(before)}+{_format_number(after)}", " miles.")  # fmt: skip

    return problem


def _balance(rng: random.Random) -> _Problem:
    name = rng.choice(_NAMES)
    balance = rng.randint(100, 900)
    rent = rng.randint(balance // 2, balance + 200)
    phone = rng.randint(20, 150)

    problem = _Problem(
        f"{name} has ${balance} in a bank account. {name} pays ${rent} for rent and ${phone} for a phone bill. What is the balance of the account now, in dollars?"
    )

    after_rent = problem.step("After the rent, the balance is ", f"{balance}-{rent}", " dollars.")  # fmt: skip
    problem.step("After the phone bill, the balance is ", f"{_format_number(after_rent)}-{phone}", " dollars.")  # fmt: skip

    return problem


def _recipe(rng: random.Random) -> _Problem:
    cups = rng.choice((Decimal("0.5"), Decimal("0.75"), Decimal("1.25"), Decimal("1.5"), Decimal("2.25")))  # fmt: skip
    batches = rng.randint(2, 9)
    extra = rng.randint(1, 4)

    problem = _Problem(
        f"A recipe needs {_format_number(cups)} cups of flour for each batch of muffins. A baker makes {batches} batches and uses {extra} more cups of flour to dust the table. How many cups of flour does the baker use in total?"
    )

    muffins = problem.step("The muffins need ", f"{_format_number(cups)}*{batches}", " cups of flour.")  # fmt: skip
    problem.step("The baker uses ", f"{_format_number(muffins)}+{extra}", " cups of flour in total.")  # fmt: skip

    return problem


def _stadium(rng: random.Random) -> _Problem:
    rows = rng.randint(30, 90)
    seats = rng.randint(40, 120)
    empty = rng.randint(1, rows * seats // 3)

    problem = _Problem(
        f"A stadium has {rows} rows with {seats} seats in each row. At a game, {empty} seats are empty. How many people are sitting in the stadium?"
    )

    total = problem.step("The stadium has ", f"{rows}*{seats}", " seats.")
    problem.step("There are ", f"{_format_number(total)}-{empty}", " people sitting in the stadium.")  # fmt: skip

    return problem


def _average(rng: random.Random) -> _Problem:
    name = rng.choice(_NAMES)
    scores = [rng.randint(55, 100) for _ in range(2)]
    # A third score that makes the total a multiple of 3.
    third = rng.choice([s for s in range(55, 101) if (sum(scores) + s) % 3 == 0])
    scores.append(third)

    problem = _Problem(
        f"{name} scored {scores[0]}, {scores[1]} and {scores[2]} on three tests. What is {name}'s average score?"
    )

    total = problem.step("The total score is ", "+".join(map(str, scores)), ".")
    problem.step("The average score is ", f"{_format_number(total)}/3", ".")

    return problem


_PROBLEMS: Final[Sequence[Callable[[random.Random], _Problem]]] = (
    _half_as_many,
    _shopping_change,
    _temperature,
    _factory,
    _savings,
    _sharing,
    _distance,
    _balance,
    _recipe,
    _stadium,
    _average,
)
