"""Directories the package builds once and caches (the tokenizer files, the
synthetic corpora), safe to build from concurrent processes."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def build_dir_atomically(write: Callable[[Path], None], path: Path) -> None:
    """Calls ``write`` on a fresh temporary directory next to ``path`` and
    renames it to ``path``.

    Ranks and test workers may build the same directory at the same time: the
    first rename wins and the others are discarded, so a reader never sees a
    half-written directory. The contents must be deterministic.
    """
    path.parent.mkdir(parents=True, exist_ok=True)

    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))

    try:
        write(tmp_dir)

        tmp_dir.chmod(0o755)

        try:
            tmp_dir.rename(path)
        except OSError:
            if not path.is_dir():
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
