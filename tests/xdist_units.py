"""The work units of a pytest-xdist run (``--dist loadfile``): a test file, so
that module and session fixtures are built once per file, except for the
directories in :data:`ONE_UNIT_DIRS`, whose files all go to one worker.

Imported by the root ``conftest.py`` only under pytest-xdist, which the test
extras install.
"""

from __future__ import annotations

from typing import Final, final

from typing_extensions import override
from xdist.scheduler import LoadFileScheduling

ONE_UNIT_DIRS: Final = (
    # The SLURM tests share one session-scoped cluster (munged, slurmctld,
    # slurmd on fixed ports and a fixed directory, behind a machine-wide
    # lock): on two workers, the second would wait for the first worker's
    # session to end, then start a second cluster.
    "tests/slurm/",
)


@final
class FileScheduling(LoadFileScheduling):
    """``--dist loadfile`` with the files of :data:`ONE_UNIT_DIRS` as one unit."""

    @override
    def _split_scope(self, nodeid: str) -> str:
        for directory in ONE_UNIT_DIRS:
            if nodeid.startswith(directory):
                return directory

        return super()._split_scope(nodeid)
