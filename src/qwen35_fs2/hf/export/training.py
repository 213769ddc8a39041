"""Exporting the checkpoints of a training run as they are saved
(``regime.export_hugging_face: true``).

fairseq2's trainer would run its own exporter (``python -m
fairseq2.models.utils.hg_export``), which cannot export the Qwen3.5 families:
its saver needs a configuration class of the installed transformers 4.57,
which has no Qwen3.5. Our recipes run this one instead, from a checkpoint
save hook (:mod:`qwen35_fs2.recipes.hf_export`): like fairseq2's, it runs
the export in a subprocess on rank 0 while training goes on, one export at a
time, and leaves the command line and its output next to the export
(``step_N/hg.run``, ``hg.stdout``, ``hg.stderr``), but the command is
``fairseq2 lm export_hf`` (as ``python -m qwen35_fs2.cli.export_hf``), and a
failed export is an error in the run's log that quotes the command's own
message and exit status. Training goes on after a failure, as with
fairseq2's exporter.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Final, final

from fairseq2.gang import Gangs
from fairseq2.logging import log

_EXPORT_MODULE: Final = "qwen35_fs2.cli.export_hf"

_STDERR_TAIL_LINES: Final = 8
"""The lines of the command's error output that a failure quotes."""


@final
class HfCheckpointExporter:
    """Exports the checkpoint of a step of a training run to
    ``<checkpoint_dir>/step_N/hg``, in the background on rank 0; the other
    ranks do nothing.

    The subprocess gets an empty environment, as fairseq2's exporter does,
    so that the training run's distributed settings do not reach it.
    """

    def __init__(self, checkpoint_dir: Path, gangs: Gangs, *, run_dir: Path, adapter: bool = False) -> None:
        """
        :param run_dir: The run's output directory, which holds its
            config.yaml (``export_hf --run-dir``): the checkpoints may be
            elsewhere (``--checkpoint-dir``).
        :param adapter: If ``True``, the run is a LoRA run, whose checkpoints
            hold adapters alone: each is exported as a PEFT adapter
            directory (``export_hf --adapter``).
        """
        self._checkpoint_dir = checkpoint_dir
        self._run_dir = run_dir
        self._adapter = adapter
        self._is_exporting_rank = gangs.root.rank == 0
        self._executor: ThreadPoolExecutor | None = None
        self._export_op: Future[bool] | None = None

    def export(self, step_nr: int) -> None:
        """Starts exporting the checkpoint of ``step_nr``, once the export
        started before it, if any, is done."""
        self.wait()

        if not self._is_exporting_rank:
            return

        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_export")

        log.info("Exporting the Hugging Face model of step {} in the background.", step_nr)

        self._export_op = self._executor.submit(self._run, step_nr)

    def wait(self) -> bool | None:
        """Waits for the export in progress, if any; returns whether it
        succeeded, or ``None`` if there was none."""
        if self._export_op is None:
            return None

        succeeded = self._export_op.result()

        self._export_op = None

        return succeeded

    def close(self) -> None:
        """Waits for the export in progress, if any, and stops the
        background thread."""
        self.wait()

        if self._executor is not None:
            self._executor.shutdown()

            self._executor = None

    def command(self, step_nr: int) -> list[str]:
        """Returns the command that exports the checkpoint of ``step_nr``."""
        command = [
            sys.executable, "-m", _EXPORT_MODULE, str(self._checkpoint_dir), str(self._export_dir(step_nr)),
            "--step", str(step_nr), "--run-dir", str(self._run_dir), "--no-rich",
        ]  # fmt: skip

        if self._adapter:
            command.append("--adapter")

        return command

    def _export_dir(self, step_nr: int) -> Path:
        return self._checkpoint_dir / f"step_{step_nr}" / "hg"

    def _run(self, step_nr: int) -> bool:
        command = self.command(step_nr)

        export_dir = self._export_dir(step_nr)

        stdout_file = export_dir.with_suffix(".stdout")
        stderr_file = export_dir.with_suffix(".stderr")

        try:
            export_dir.with_suffix(".run").write_text(shlex.join(command), encoding="utf-8")

            with stdout_file.open("w", encoding="utf-8") as stdout, stderr_file.open("w", encoding="utf-8") as stderr:
                returncode = subprocess.run(command, stdout=stdout, stderr=stderr, env={}).returncode
        except OSError as ex:
            log.error("Hugging Face export of step {} FAILED: it cannot be run ({}).", step_nr, ex)

            return False

        if returncode == 0:
            log.info("Hugging Face model of step {} exported to {}.", step_nr, export_dir)

            return True

        lines = [f"    {line}" for line in _error_lines(stderr_file)]

        log.error("\n".join([f"Hugging Face export of step {step_nr} FAILED (exit status {returncode}); the last lines of {stderr_file}:", *lines]))  # fmt: skip

        return False


def _error_lines(stderr_file: Path) -> list[str]:
    """Returns the error message of the export command and what follows it,
    else the end of its output."""
    try:
        lines = stderr_file.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as ex:
        return [f"(its output cannot be read: {ex})"]

    lines = [line for line in lines if line.strip()]

    error_idx = next((i for i, line in enumerate(lines) if " ERROR" in line), None)

    if error_idx is None:
        return lines[-_STDERR_TAIL_LINES:]

    return [lines[error_idx], *lines[error_idx + 1 :][-(_STDERR_TAIL_LINES - 1) :]]
