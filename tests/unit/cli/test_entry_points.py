"""The command's entry points (``qwen35_fs2.cli``): they import the command
with the garbage collector off and freeze what the imports made, collect and
freeze again at the process's end, and the packages on the way to them import
nothing heavy, which that needs. Each runs in a fresh Python process, as the
commands do."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from importlib import import_module
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import qwen35_fs2.cli
import qwen35_fs2.recipes.sft

# The packages on the way to the entry points (`python -m` imports a
# recipe's package before its `__main__`).
_LAZY_PACKAGES = ("qwen35_fs2", *(f"qwen35_fs2.recipes.{name}" for name in ("sft", "train", "generate", "eval_gsm8k")))

# Who imports these has imported PyTorch, fairseq2 or transformers.
_HEAVY_MODULES = ("torch", "fairseq2", "transformers")

# What the entry point's process reports: the state of its garbage collector
# right after `command()` returned and from the last exit hook (registered
# first, so run after the entry point's), and which objects of a reference
# cycle dropped after the command were finalized before that hook.
_COMMAND_SCRIPT = """
import atexit, gc, json, sys

import qwen35_fs2.cli

finalized = []
report = {}

def _report_at_exit():
    report["frozen_at_exit"] = gc.get_freeze_count()
    report["finalized_before_the_last_hook"] = list(finalized)
    print(json.dumps(report))

atexit.register(_report_at_exit)

sys.argv = ["fairseq2", "lm", "instruction_finetune", "--dump-config"]

report["returned"] = qwen35_fs2.cli.command()
report["enabled"] = gc.isenabled()
report["frozen_after_command"] = gc.get_freeze_count()

class _Node:
    def __del__(self):
        finalized.append("node")

a, b = _Node(), _Node()
a.other, b.other = b, a
del a, b
"""


def _run_python(code: str) -> str:
    process = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)  # fmt: skip

    assert process.returncode == 0, process.stdout

    return process.stdout


def test_the_packages_before_the_entry_points_import_nothing_heavy() -> None:
    modules = ["qwen35_fs2.cli", *_LAZY_PACKAGES]

    code = f"import json, sys\nfor m in {modules!r}: __import__(m)\nprint(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {_HEAVY_MODULES!r})))"  # fmt: skip

    assert json.loads(_run_python(code).splitlines()[-1]) == []


def test_the_command_imports_without_the_collector_and_collects_then_freezes_at_its_end() -> None:
    report = json.loads(_run_python(_COMMAND_SCRIPT).splitlines()[-1])

    assert report["returned"] == 0 and report["enabled"]

    # PyTorch, dynamo, transformers and fairseq2 make about 360,000 objects.
    assert report["frozen_after_command"] > 200_000

    # The cycle was collected, and finalized, before what was left was frozen.
    assert report["finalized_before_the_last_hook"] == ["node", "node"]

    assert report["frozen_at_exit"] > report["frozen_after_command"]


def test_the_console_scripts_are_the_entry_point() -> None:
    scripts = {script.name: script for script in entry_points(group="console_scripts") if script.value.startswith("qwen35_fs2")}  # fmt: skip

    assert {name: script.load() for name, script in scripts.items()} == {
        "fairseq2": qwen35_fs2.cli.command,
        "qwen35-fs2": qwen35_fs2.cli.command,
    }


@pytest.mark.parametrize("package", _LAZY_PACKAGES)
def test_each_name_the_type_checkers_see_is_the_defining_modules_object(package: str) -> None:
    module = import_module(package)

    # The names the package imports under `TYPE_CHECKING`.
    tree = ast.parse(Path(str(module.__file__)).read_text(encoding="utf-8"))

    checked = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")

    imports = [(node.module, alias.name) for node in checked.body if isinstance(node, ast.ImportFrom) for alias in node.names]

    assert imports

    for defining_module, name in imports:
        assert getattr(module, name) is getattr(import_module(str(defining_module)), name), name


def test_another_name_is_an_attribute_error_naming_it() -> None:
    with pytest.raises(AttributeError, match=r"^module 'qwen35_fs2.recipes.sft' has no attribute 'Recipe'$"):
        _ = qwen35_fs2.recipes.sft.Recipe
