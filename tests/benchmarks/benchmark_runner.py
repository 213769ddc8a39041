"""Runs a script of ``benchmarks/`` as users run it, in a subprocess, and
reads the JSON line it prints last (every benchmark's report)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_benchmark_script(script: str, *options: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *options], capture_output=True, text=True, env=env, timeout=1800
    )


def read_report(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The report of a run that must have succeeded."""
    assert result.returncode == 0, result.stderr

    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
