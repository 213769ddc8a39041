"""Package attributes imported when they are first used (PEP 562).

Why: the packages on the way to the command's entry points
(:mod:`qwen35_fs2`, the recipes' packages that ``python -m`` imports before
their ``__main__``) import nothing heavy, so that the entry points
(:mod:`qwen35_fs2.cli`) can import PyTorch, fairseq2 and transformers
themselves, with the garbage collector off. Each package names its public
attributes once more under ``TYPE_CHECKING``, for type checkers
(``tests/unit/cli/test_entry_points.py`` checks that the two agree).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, Sequence[str]]) -> Callable[[str], Any]:
    """Returns the module ``__getattr__`` of ``package``, which imports each
    name of ``exports`` (a submodule of ``package`` and the names it defines)
    the first time it is asked for and keeps it in the package."""
    modules = {name: f"{package}.{submodule}" for submodule, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = modules.get(name)

        if module is None:
            raise AttributeError(f"module '{package}' has no attribute '{name}'")

        value = getattr(import_module(module), name)

        setattr(sys.modules[package], name, value)

        return value

    return __getattr__
