"""The command's entry points (``qwen35_fs2.cli``): they import the command
with the garbage collector off and freeze what the imports made, collect and
freeze again at the process's end, and the packages on the way to them import
nothing heavy, which that needs. Each runs in a fresh Python process, as the
commands do."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

import qwen35_fs2
import qwen35_fs2.cli
import qwen35_fs2.hf.loading
import qwen35_fs2.recipes.sft
import qwen35_fs2.recipes.sft.recipe

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
    modules = ["qwen35_fs2", "qwen35_fs2.cli", *(f"qwen35_fs2.recipes.{name}" for name in ("sft", "train", "generate", "eval_gsm8k"))]  # fmt: skip

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


def test_lazy_exports_are_the_defining_modules_objects() -> None:
    assert qwen35_fs2.load_hf_model is qwen35_fs2.hf.loading.load_hf_model

    assert qwen35_fs2.recipes.sft.InstructionFinetuneRecipe is qwen35_fs2.recipes.sft.recipe.InstructionFinetuneRecipe

    with pytest.raises(AttributeError, match=r"^module 'qwen35_fs2.recipes.sft' has no attribute 'Recipe'$"):
        _ = qwen35_fs2.recipes.sft.Recipe
