"""The ``fairseq2`` command (alias ``qwen35-fs2``): ``fairseq2 lm <recipe>``
runs our recipes (:mod:`qwen35_fs2.cli.main`), ``fairseq2 lm export_hf``
exports a checkpoint to Hugging Face (:mod:`qwen35_fs2.cli.export_hf`).

The entry points of the command's processes are here, apart from the
command itself: the console scripts, ``python -m qwen35_fs2.cli`` and the
recipes' ``python -m qwen35_fs2.recipes.<recipe>`` (under ``torchrun`` and
SLURM, one a rank). This module and the packages on the way to it import
nothing heavy, so that the entry points import the command, and with it
PyTorch, dynamo, transformers and fairseq2, with the cyclic garbage
collector off, then freeze what the imports made (:func:`gc.freeze`), which
the collector then skips.

Why: those imports make about 360,000 objects, and the collector traversed
them time and again while they were made, and again in the interpreter's
last collections at the process's end: together about 4 s of CPU of every
recipe process on a 2-core AMD EPYC (docs/performance.md, "A process's
start and end: the garbage collector"), more than some of their runs train.
At the process's end, the garbage the run made is collected before what is
left is frozen, so that it is finalized as the interpreter would have done;
what the collector then skips is what the modules hold to their end, mostly
their classes and functions.

:func:`qwen35_fs2.cli.main.main`, which the tests call in their own
processes, leaves the collector as it is.
"""

from __future__ import annotations

import atexit
import gc
import sys
from types import ModuleType


def command() -> int:
    """The ``fairseq2`` and ``qwen35-fs2`` commands and ``python -m
    qwen35_fs2.cli``: :func:`qwen35_fs2.cli.main.main` on the arguments of
    the process."""
    return _import_the_command().main()


def run_recipe_module(command_name: str) -> int:
    """``python -m qwen35_fs2.recipes.<module>``: the recipe
    ``command_name`` on the arguments of the process."""
    cli_main = _import_the_command()

    return cli_main.main([cli_main.LM_GROUP, command_name, *sys.argv[1:]])


def _import_the_command() -> ModuleType:
    """Imports :mod:`qwen35_fs2.cli.main` without the garbage collector and
    has the process collect and freeze at its end (see the module)."""
    gc.disable()

    try:
        import qwen35_fs2.cli.main as cli_main
    finally:
        _collect_and_freeze()

        gc.enable()

    # `atexit` runs the last registered first: this runs after the hooks
    # registered during the run and before those of the imports (`logging`
    # closes its handlers then, not the garbage collector).
    atexit.register(_collect_and_freeze)

    return cli_main


def _collect_and_freeze() -> None:
    gc.collect()

    gc.freeze()
