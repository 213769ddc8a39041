"""Package attributes imported when they are first used (PEP 562).

Why: the packages on the way to the command's entry points
(:mod:`qwen35_fs2`, the recipes' packages that ``python -m`` imports before
their ``__main__``) import nothing heavy, so that the entry points
(:mod:`qwen35_fs2.cli`) can import PyTorch, fairseq2 and transformers
themselves, with the garbage collector off. Each package names its public
attributes once more under ``TYPE_CHECKING``, for type checkers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """Returns the module ``__getattr__`` of ``package``, which imports each
    attribute of ``exports`` (its name and the module that defines it) the
    first time it is asked for and keeps it in the package."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)

        if module is None:
            raise AttributeError(f"module '{package}' has no attribute '{name}'")

        value = getattr(import_module(module), name)

        setattr(sys.modules[package], name, value)

        return value

    return __getattr__
