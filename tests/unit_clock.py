"""How long each work unit of a run took (a test file, or a directory of
``xdist_units.ONE_UNIT_DIRS``): a line as each long unit ends, and the
longest units at the end of the run.

Why: CI keeps the end of what a run printed, and when it stops a run at its
time limit pytest prints no summary at all, ``--durations`` included. The
lines written as the units end still say where the time went. The root
``conftest.py`` registers the clock in the controlling process (the only
process of a serial run) at the start of the session; the ini option ``unit_clock_min_seconds`` (30 by
default) sets which units are long.

A unit's time is its worker's wall time from the end of the worker's
previous unit (or the start of the run) to the unit's last report: its
module fixtures count, and so does any wait for the lock that a module
marked ``alone`` holds. A unit's line is written when its worker reports
from its next unit, or at the end of the run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Final, final

import pytest

from xdist_units import work_unit

MIN_SECONDS_INI: Final = "unit_clock_min_seconds"

NUM_LONGEST: Final = 15
"""How many units the summary at the end of the run lists."""


@dataclass
class _Unit:
    name: str
    worker: str
    start: float
    end: float
    num_tests: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


@final
class UnitClock:
    """Times the work units from the reports that reach the controlling
    process, one unit at a time per worker (``--dist loadfile``)."""

    def __init__(self, config: pytest.Config, terminal: pytest.TerminalReporter, min_seconds: float) -> None:
        self._config = config
        self._terminal = terminal
        self._min_seconds = min_seconds
        self._start = time.time()
        # The unit each worker is running.
        self._running: dict[str, _Unit] = {}
        self._done: list[_Unit] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # pytest-xdist's controller sets `node` on the reports of its workers.
        node = getattr(report, "node", None)

        worker = "serial" if node is None else str(node.gateway.id)

        now = time.time()

        name = work_unit(report.nodeid)

        unit = self._running.get(worker)

        if unit is None or unit.name != name:
            if unit is not None:
                self._finish(unit)

            unit = _Unit(name=name, worker=worker, start=self._start if unit is None else unit.end, end=now)

            self._running[worker] = unit

        unit.end = now

        # Every test reports its teardown once, whatever its outcome.
        if report.when == "teardown":
            unit.num_tests += 1

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        for unit in self._running.values():
            self._finish(unit)

        self._running.clear()

        longest = sorted((unit for unit in self._done if unit.seconds >= self._min_seconds), key=lambda u: -u.seconds)

        if not longest:
            return

        terminalreporter.write_sep("-", f"longest work units (of {self._min_seconds:g} s or more)")

        for unit in longest[:NUM_LONGEST]:
            terminalreporter.write_line(f"{unit.seconds:8.1f} s  {unit.worker}  {unit.name} ({unit.num_tests} tests)")

    def _finish(self, unit: _Unit) -> None:
        self._done.append(unit)

        if unit.seconds >= self._min_seconds:
            clock = time.strftime("%H:%M:%S", time.localtime(unit.end))

            # Not after the progress dots of a run on workers, which
            # `write_line` continues.
            writer = self._config.get_terminal_writer()

            if writer.width_of_current_line:
                writer.line()

            self._terminal.write_line(f"[{clock}] {unit.worker} ran {unit.name} ({unit.num_tests} tests) in {unit.seconds:.1f} s")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(MIN_SECONDS_INI, "the shortest work unit whose time the run prints (seconds)", default="30")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Registers the clock in the controlling process of a run."""
    config = session.config

    if hasattr(config, "workerinput"):
        return

    terminal = config.pluginmanager.get_plugin("terminalreporter")

    # `-p no:terminal`: nowhere to print.
    if terminal is None:
        return

    value = config.getini(MIN_SECONDS_INI)

    try:
        min_seconds = float(value)
    except ValueError:
        raise pytest.UsageError(f"`{MIN_SECONDS_INI}` must be a number of seconds, but is {value!r} instead.") from None

    config.pluginmanager.register(UnitClock(config, terminal, min_seconds), "qwen35-unit-clock")
