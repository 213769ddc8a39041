"""The work units of a pytest-xdist run (``--dist loadfile``): a test file, so
that module and session fixtures are built once per file, except for the
directories in :data:`ONE_UNIT_DIRS`, whose files all go to one worker.

Imported by the root ``conftest.py`` under pytest-xdist, which the test
extras install, and by ``unit_clock.py`` in every run.
"""

from __future__ import annotations

from typing import Final, final

import pytest
from typing_extensions import override
from xdist.remote import Producer
from xdist.scheduler import LoadFileScheduling

ONE_UNIT_DIRS: Final = (
    # The SLURM tests share one session-scoped cluster (munged, slurmctld,
    # slurmd on fixed ports and a fixed directory, behind a machine-wide
    # lock): on two workers, the second would wait for the first worker's
    # session to end, then start a second cluster.
    "tests/slurm/",
)


def work_unit(nodeid: str) -> str:
    """The unit of the test ``nodeid``: its file, or its directory of
    :data:`ONE_UNIT_DIRS`."""
    for directory in ONE_UNIT_DIRS:
        if nodeid.startswith(directory):
            return directory

    return nodeid.split("::", 1)[0]


@final
class FileScheduling(LoadFileScheduling):
    """``--dist loadfile`` with the files of :data:`ONE_UNIT_DIRS` as one
    unit, handed out in the order of the collection (which
    ``parallel_runs.py`` sorts), not xdist's (the units of the most tests
    first)."""

    def __init__(self, config: pytest.Config, log: Producer | None = None) -> None:
        config.option.loadscopereorder = False

        super().__init__(config, log)

    @override
    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)
