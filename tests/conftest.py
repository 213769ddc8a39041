"""Test-session setup shared by every test."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

# A failing registration must fail the tests, not become a warning.
os.environ.setdefault("FAIRSEQ2_EXTENSION_TRACE", "1")

# PyTorch's CPU allocations of 2 MiB and more on transparent huge pages (the
# test machines' kernels have THP in `madvise` mode, which needs this
# variable): a page fault costs up to 12 µs there in the machines' slow hours,
# and a training run faults each fresh buffer in 4 KiB at a time, millions of
# faults a run. Set before anything allocates; every process of the suite
# (recipe runs, `torchrun` ranks, workers) inherits it. docs/performance.md,
# "Page faults and huge pages"; tests/unit/test_huge_pages.py pins it.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from fla_interpreter import hopper_with_triton_3_6 as hopper_with_triton_3_6  # noqa: E402
from fla_interpreter import use_triton_interpreter_without_cuda  # noqa: E402
from hf_reference.fixtures import hf_tiny_models as hf_tiny_models  # noqa: E402
from hf_reference.fixtures import one_hf_reference_subprocess_a_module as one_hf_reference_subprocess_a_module  # noqa: E402
from parallel_runs import _alone_modules_run_alone as _alone_modules_run_alone  # noqa: E402
from parallel_runs import pytest_collection_modifyitems as pytest_collection_modifyitems  # noqa: E402
from parallel_runs import pytest_configure as pytest_configure  # noqa: E402
from parallel_runs import pytest_configure_node as pytest_configure_node  # noqa: E402
from parallel_runs import pytest_unconfigure as pytest_unconfigure  # noqa: E402
from parallel_runs import pytest_xdist_make_scheduler as pytest_xdist_make_scheduler  # noqa: E402
from unit_clock import pytest_addoption as pytest_addoption  # noqa: E402
from unit_clock import pytest_sessionstart as pytest_sessionstart  # noqa: E402

# Without a GPU, fla's kernels run under Triton's interpreter; this must
# happen before anything imports fla.
use_triton_interpreter_without_cuda()


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """An empty directory nobody may write to: a read-only tmpfs for root,
    whom file modes do not stop, a mode-0555 directory otherwise."""
    path = tmp_path / "ro"

    path.mkdir()

    if os.geteuid() != 0:
        path.chmod(0o555)

        try:
            yield path
        finally:
            path.chmod(0o755)

        return

    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], capture_output=True, text=True)

    if mount.returncode != 0:
        pytest.skip(f"running as root and cannot mount a read-only tmpfs: {mount.stderr.strip()}")

    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)
