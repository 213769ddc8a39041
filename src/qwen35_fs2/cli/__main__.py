"""``python -m qwen35_fs2.cli``: the ``fairseq2`` command."""

from __future__ import annotations

import sys

from qwen35_fs2.cli import command

sys.exit(command())
