"""Every test of the suite checks something: a test function without an
``assert``, a ``pytest.raises``/``warns``/``fail`` or an ``assert*`` call (its
own, or in a function of its module that it calls) passes whatever the code
does."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]

# `torch.library.opcheck` raises at the first check of a custom operator
# that fails.
_CHECK_CALLS = frozenset({"raises", "warns", "fail", "deprecated_call", "opcheck"})


def _called_name(call: ast.Call) -> str:
    func = call.func

    if isinstance(func, ast.Attribute):
        return func.attr

    if isinstance(func, ast.Name):
        return func.id

    return ""


def _checks_directly(function: ast.AST) -> bool:
    for node in ast.walk(function):
        if isinstance(node, ast.Assert):
            return True

        if isinstance(node, ast.Call):
            name = _called_name(node)

            if name in _CHECK_CALLS or name.lstrip("_").startswith("assert"):
                return True

    return False


def find_tests_without_checks(source: str) -> list[tuple[int, str]]:
    """Returns the line and name of each test function of the module
    ``source`` that checks nothing."""
    functions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]

    # The functions of the module that check, directly or through another
    # function of the module that they call.
    checking = {f.name for f in functions if _checks_directly(f)}

    changed = True

    while changed:
        changed = False

        for function in functions:
            if function.name in checking:
                continue

            calls = {_called_name(n) for n in ast.walk(function) if isinstance(n, ast.Call)}

            if calls & checking:
                checking.add(function.name)

                changed = True

    return [(f.lineno, f.name) for f in functions if f.name.startswith("test") and f.name not in checking]


class TestTestsCanFail:
    def test_every_test_function_checks_something(self) -> None:
        files = sorted(TESTS_DIR.rglob("test_*.py"))

        assert len(files) > 50

        offenders = [
            f"{path.relative_to(TESTS_DIR)}:{lineno} {name}"
            for path in files
            for lineno, name in find_tests_without_checks(path.read_text(encoding="utf-8"))
        ]

        assert offenders == []

    def test_finds_a_test_that_checks_nothing(self) -> None:
        source = (
            "def _helper(x):\n    assert x == 1\n\n"
            "def test_checks_through_a_helper():\n    _helper(1)\n\n"
            "def test_raises():\n    with pytest.raises(ValueError):\n        int('x')\n\n"
            "def test_calls_an_assert_function():\n    torch.testing.assert_close(1, 1)\n\n"
            "def test_checks_an_operator():\n    torch.library.opcheck(op, args)\n\n"
            "def test_checks_nothing():\n    int('1')\n"
        )

        assert find_tests_without_checks(source) == [(17, "test_checks_nothing")]
