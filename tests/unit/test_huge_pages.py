"""The suite runs PyTorch's CPU allocations on transparent huge pages
(``THP_MEM_ALLOC_ENABLE=1``, set by ``tests/conftest.py``): this pins that
PyTorch still honours the variable, and that it is the variable, not the
kernel's own setting, that gives the huge pages. Were it dropped, the suite
would run as before, only slower, and nothing else would notice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# Large enough to hold several 2 MiB pages wherever it lands.
_NUM_BYTES = 64 << 20

# Prints how many bytes of anonymous huge pages the process gained by
# allocating and filling `_NUM_BYTES` with PyTorch.
_MEASURE = f"""
import torch

def huge_bytes():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no AnonHugePages in /proc/self/smaps_rollup")

before = huge_bytes()
x = torch.empty({_NUM_BYTES}, dtype=torch.uint8)
x.fill_(1)
print(huge_bytes() - before)
"""


def _thp_mode() -> str:
    """The kernel's THP mode: the bracketed word of ``always madvise never``."""
    try:
        text = _THP_MODE_FILE.read_text()
    except OSError:
        return "unsupported"

    return text[text.index("[") + 1 : text.index("]")]


def _huge_bytes_gained(env: dict[str, str]) -> int:
    process = subprocess.run([sys.executable, "-c", _MEASURE], env=env, capture_output=True, text=True, timeout=600)

    assert process.returncode == 0, process.stderr

    return int(process.stdout)


def test_the_suite_allocates_on_huge_pages() -> None:
    assert os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"

    mode = _thp_mode()

    if mode not in ("always", "madvise"):
        pytest.skip(f"the kernel's transparent huge pages are `{mode}`")

    with_variable = _huge_bytes_gained(dict(os.environ))

    # At least half of the buffer: its ends may fall outside whole 2 MiB
    # pages, and the kernel may fall back to small pages for a few.
    assert with_variable >= _NUM_BYTES // 2, with_variable

    if mode == "madvise":
        # Without the variable PyTorch does not advise huge pages, and the
        # kernel in `madvise` mode gives none.
        without_variable = _huge_bytes_gained({k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"})

        assert without_variable == 0, without_variable

