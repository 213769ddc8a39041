"""Running the suite on several pytest-xdist workers (``make test`` runs two).

The root ``conftest.py`` re-exports the hooks and the fixture of this module.
A serial run is left as it is; under pytest-xdist:

- each worker, and every process it starts, computes on one thread: on 2
  cores, two workers of 2 threads each made small-op tests up to 15 times
  slower;
- the work units are test files, so that module and session fixtures are
  built once per file, and the SLURM tests are one unit (``xdist_units.py``);
  the long ones are handed out first;
- a module marked ``alone`` (a module-level ``pytestmark``) runs with no
  other module beside it: it uses so much of the machine's memory that one
  more test could bring in the kernel's OOM killer. It holds the lock file
  of the run exclusively, every other module holds it shared. A module
  waiting to run alone holds a second lock, the turnstile, which the others
  pass before taking theirs, so that they cannot keep it waiting forever
  (``flock`` lets a shared lock in past a waiting exclusive one).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
import torch

from hf_reference import end_hf_reference_subprocess

_LOCK_DIR: Final = "qwen35_lock_dir"
"""The key of the run's lock directory in a worker's ``workerinput``."""

_LOCK_DIR_KEY: Final = pytest.StashKey[Path]()

if "PYTEST_XDIST_WORKER" in os.environ:
    # Before anything starts a process or a thread pool.
    os.environ["OMP_NUM_THREADS"] = "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "alone: the module needs much of the machine's memory; under pytest-xdist no other module runs beside it",
    )

    if hasattr(config, "workerinput"):
        torch.set_num_threads(1)


def pytest_unconfigure(config: pytest.Config) -> None:
    lock_dir = config.stash.get(_LOCK_DIR_KEY, None)

    if lock_dir is not None:
        shutil.rmtree(lock_dir, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Gives every worker of the run the same lock directory."""
    stash = node.config.stash

    if _LOCK_DIR_KEY not in stash:
        stash[_LOCK_DIR_KEY] = Path(tempfile.mkdtemp(prefix="qwen35-test-locks-"))

    node.workerinput[_LOCK_DIR] = str(stash[_LOCK_DIR_KEY])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadfile":
        return None

    from xdist_units import FileScheduling

    return FileScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("alone") is None:
            continue

        module = item.getparent(pytest.Module)

        if module is None or module.get_closest_marker("alone") is None:
            raise pytest.UsageError(
                f"`alone` must mark a whole module (its `pytestmark`), but marks {item.nodeid} only instead."
            )

    if hasattr(config, "workerinput"):
        _put_long_units_first(items)


def _put_long_units_first(items: list[pytest.Item]) -> None:
    """Sorts the work units of a pytest-xdist worker's collection, which is
    the order the workers take them in: the modules marked ``alone`` first,
    then the units holding a test marked ``slow``, then those of fast tests
    only, each group in the order of the collection. The short units then
    even out the workers' ends; in xdist's order (the units of the most tests
    first) the long integration modules of a few tests each came last."""
    from xdist_units import work_unit

    ranks: dict[str, int] = {}

    for item in items:
        if item.get_closest_marker("alone") is not None:
            rank = 0
        elif item.get_closest_marker("slow") is not None:
            rank = 1
        else:
            rank = 2

        unit = work_unit(item.nodeid)

        ranks[unit] = min(ranks.get(unit, rank), rank)

    items.sort(key=lambda item: ranks[work_unit(item.nodeid)])


@pytest.fixture(scope="module", autouse=True)
def _alone_modules_run_alone(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under pytest-xdist, holds the run's lock for the module: exclusively
    for a module marked ``alone``, shared otherwise."""
    workerinput: dict[str, Any] = getattr(request.config, "workerinput", {})

    lock_dir = workerinput.get(_LOCK_DIR)

    if lock_dir is None:
        yield

        return

    alone = request.node.get_closest_marker("alone") is not None

    # A session fixture set up for this module may have started the worker's
    # reference subprocess (hf_reference.fixtures); it is not kept idle,
    # most of a GiB, through the wait, which may be an `alone` module's run.
    end_hf_reference_subprocess()

    with open(Path(lock_dir, "turnstile"), "a") as turnstile, open(Path(lock_dir, "modules"), "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)

        if alone:
            fcntl.flock(lock, fcntl.LOCK_EX)

            fcntl.flock(turnstile, fcntl.LOCK_UN)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)

            fcntl.flock(lock, fcntl.LOCK_SH)

        # Closing the files releases the lock.
        yield
