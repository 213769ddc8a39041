from __future__ import annotations

import pytest

from qwen35_fs2.datasets.gsm8k import extract_gsm8k_answer

# The last lines of real `openai/gsm8k` answers.
_NATALIA = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"


class TestExtractFinalAnswer:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            (_NATALIA, "72"),
            ("He has 1,000 + 234 = <<1000+234=1234>>1234 stamps.\n#### 1,234", "1234"),
            ("The temperature drops to 5-12 = <<5-12=-7>>-7 degrees.\n#### -7", "-7"),
            ("Each costs 7/2 = <<7/2=3.5>>3.5 dollars.\n#### 3.5", "3.5"),
            ("#### 0.25", "0.25"),
            ("#### $18", "18"),
            ("#### 1,234,567.50", "1234567.5"),
            ("#### 12.00", "12"),
            ("#### 3000", "3000"),
            ("#### -0", "0"),
            # The number after the last marker counts, not the calculator notes.
            ("#### 5\nwait, recount: 2 + 4 = <<2+4=6>>6\n#### 6", "6"),
        ],
    )
    def test_extracts_the_number_after_the_final_marker(self, text: str, expected: str) -> None:
        assert extract_gsm8k_answer(text) == expected

    def test_equal_numbers_in_other_notations_extract_equal(self) -> None:
        notations = ["#### 1,234", "#### 1234", "#### 1234.0", "#### $1,234.00"]

        assert {extract_gsm8k_answer(t) for t in notations} == {"1234"}

    def test_takes_the_last_number_of_a_text_without_marker(self) -> None:
        assert extract_gsm8k_answer("So she has 3 apples and 12 pears, 15 fruits.") == "15"

        assert extract_gsm8k_answer("The balance is -222 dollars.") == "-222"

    @pytest.mark.parametrize(
        "text",
        [
            "#### Step 1: Find the total\nShe has 48 + 24 = 72 clips.\n\nThe answer is 72.",
            "### Step 1\n48/2=24\n#### Step 2: add\n48+24 = 72\n\n**Answer: 72**",
            "##### Note: 3 items\nAnswer: 72",
        ],
        ids=["heading", "heading-then-bold", "level-5-heading"],
    )
    def test_a_markdown_heading_is_no_final_answer_marker(self, text: str) -> None:
        # A chat model's free-form answer in Markdown.
        assert extract_gsm8k_answer(text) == "72"

    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("Final answer:\n- 72", "72"),
            ("The answer is 72.\n\n---\n\n72", "72"),
            ("as on pages 3-18", "18"),
            ("The change is -$5.", "-5"),
            ("It drops by \u22123 degrees.", "-3"),
        ],
        ids=["bullet", "rule", "range", "minus-dollar", "unicode-minus"],
    )
    def test_a_minus_sign_must_touch_its_number(self, text: str, expected: str) -> None:
        assert extract_gsm8k_answer(text) == expected

    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("The answer is #### 72 (24 + 48, over 2 months)", "72"),
            ("So the total is: #### 18\nI hope this helps with step 1!", "18"),
            ("#### $ 18 dollars for 2 days", "18"),
        ],
    )
    def test_a_marker_inside_a_line_counts(self, text: str, expected: str) -> None:
        assert extract_gsm8k_answer(text) == expected

    def test_does_not_read_list_commas_as_thousands_separators(self) -> None:
        assert extract_gsm8k_answer("The numbers are 3,4") == "4"

    def test_does_not_read_a_malformed_group_as_a_shorter_number(self) -> None:
        # Five digits after a comma are no thousands group: `1,2345` must not
        # score as 1,234.
        assert extract_gsm8k_answer("#### 1,2345") not in ("1234", "12345")
        assert extract_gsm8k_answer("#### 12,3456") not in ("12345", "123456")
        assert extract_gsm8k_answer("#### 12,345") == "12345"

    @pytest.mark.parametrize("text", ["", "no numbers here", "#### ", "#### unknown"])
    def test_returns_none_without_a_number(self, text: str) -> None:
        assert extract_gsm8k_answer(text) is None
