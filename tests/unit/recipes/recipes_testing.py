"""Helpers of the recipe tests (importable by any test module of this
directory, hence not in ``conftest.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from qwen35_fs2.cli import main as cli

RECIPES_DIR = Path(__file__).resolve().parents[3] / "recipes"


def run_fairseq2(capfd: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """Runs the `fairseq2` command in this process; returns its exit code and
    output."""
    returncode, out, err = _run(capfd, args)

    return returncode, out + err


def dump_config(capfd: pytest.CaptureFixture[str], recipe: str, *args: str) -> dict[str, Any]:
    """Returns the configuration that ``fairseq2 lm <recipe> <args>`` would
    run with: the recipe's defaults merged with the file and overrides of
    ``args``."""
    returncode, out, err = _run(capfd, ("lm", recipe, *args, "--dump-config"))

    assert returncode == 0, out + err

    config: dict[str, Any] = yaml.safe_load(out)

    return config


def _run(capfd: pytest.CaptureFixture[str], args: tuple[str, ...]) -> tuple[int, str, str]:
    try:
        returncode = cli.main(list(args))
    except SystemExit as ex:
        returncode = ex.code  # type: ignore[assignment]

    captured = capfd.readouterr()

    return returncode, captured.out, captured.err


def read_recipe_file(name: str) -> dict[str, Any]:
    """Returns the YAML of ``recipes/<name>`` as written, not merged."""
    config: dict[str, Any] = yaml.safe_load(RECIPES_DIR.joinpath(name).read_text(encoding="utf-8"))

    return config
