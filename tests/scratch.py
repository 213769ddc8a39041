"""Temporary directories for the training runs that module-scoped fixtures
and the production-size tests share, removed as soon as their users are done.

pytest keeps what ``tmp_path_factory`` makes until the session ends. The
training runs write checkpoints of hundreds of MiB each, and of 4.8 GiB at
the production configurations' size; kept to the end, a run of the suite
held 22 GiB under ``/tmp``, and a CI run on a disk shared with other work
failed with "No space left on device". Function-scoped ``tmp_path``
directories need none of this: the suite's ``tmp_path_retention_policy =
"failed"`` (``pyproject.toml``) removes those of every passing test.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def scratch_dir(tmp_path_factory: pytest.TempPathFactory, basename: str) -> Iterator[Path]:
    """A new directory of ``tmp_path_factory``, removed with its contents when
    the block ends, whether its tests passed or failed: a failed run's logs
    are in the test's output, its checkpoints would only hold the disk."""
    path = tmp_path_factory.mktemp(basename)

    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
