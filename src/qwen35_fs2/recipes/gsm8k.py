"""Final-answer extraction for GSM8K.

GSM8K solutions end with a line ``#### <number>`` (``#### 72``, ``#### 1,234``,
``#### -3``, ``#### 0.5``). Answers are compared as numbers in a canonical
form, so ``1,234``, ``1234`` and ``1234.00`` match.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Final

FINAL_ANSWER_MARKER: Final = "####"

# An optional sign and currency sign, then a number with optional thousands
# separators and decimals.
_NUMBER_RE: Final = re.compile(
    r"(?P<sign>[-\u2212]?)\s*\$?\s*(?P<number>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)


def extract_final_answer(text: str) -> str | None:
    """Returns the final number of a GSM8K-style solution in canonical form.

    The number is the first one after the last ``####`` marker; without a
    marker, the last number of ``text``. Returns ``None`` if there is none.
    """
    marker_pos = text.rfind(FINAL_ANSWER_MARKER)

    if marker_pos >= 0:
        tail = text[marker_pos + len(FINAL_ANSWER_MARKER) :]

        match = _NUMBER_RE.search(tail)
    else:
        match = None

        for match in _NUMBER_RE.finditer(text):
            pass

    if match is None:
        return None

    return _canonicalize(match["sign"], match["number"])


def _canonicalize(sign: str, number: str) -> str | None:
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
