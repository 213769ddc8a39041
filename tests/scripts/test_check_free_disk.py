"""``scripts/check_free_disk.sh``, which ``make test`` runs first: a clear
error instead of tests failing midway on a full disk."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_free_disk.sh"


def _check(required_gib: int, tmp_dir: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TMPDIR=str(tmp_dir))

    return subprocess.run(["bash", str(SCRIPT), str(required_gib)], env=env, capture_output=True, text=True)


def test_passes_with_enough_space(tmp_path: Path) -> None:
    result = _check(0, tmp_path)

    assert (result.returncode, result.stderr) == (0, "")


def test_names_the_shortfall(tmp_path: Path) -> None:
    # More than any disk here has: what is free changes while other tests
    # write.
    result = _check(1 << 20, tmp_path)

    assert result.returncode == 1

    match = re.fullmatch(
        rf"error: the tests need 1048576 GiB free in {re.escape(str(tmp_path))} \(their peak\), but it has "
        r"(\d+) GiB free instead\. Free space there, or set TMPDIR to a directory with more\.\n",
        result.stderr,
    )

    assert match is not None, result.stderr

    # Within what other tests may write meanwhile.
    assert abs(int(match.group(1)) - (shutil.disk_usage(tmp_path).free >> 30)) <= 16


def test_rejects_a_tmpdir_that_is_not_a_directory(tmp_path: Path) -> None:
    result = _check(0, tmp_path / "missing")

    assert result.returncode == 1

    assert result.stderr == f"error: TMPDIR must be a directory, but {tmp_path / 'missing'} is not.\n"
