"""``fairseq2 lm export_hf``: exports a Qwen3.5 checkpoint as a Hugging Face
repository.

::

    fairseq2 lm export_hf CHECKPOINT OUTPUT_DIR [--step N] [--base HF_DIR_OR_CARD | --no-base]
                          [--tokenizer DIR_OR_CARD] [--dtype {bfloat16,float16,float32}]
                          [--text-only] [--max-shard-size SIZE] [--force] [--no-rich]

``CHECKPOINT`` is a fairseq2 training output directory (its latest step, or
``--step N``), its ``checkpoints`` directory, a ``step_N`` directory, a Hugging
Face model directory, or an asset card name. Without ``--base`` the base is
the model the run started from (``model.path``, or the ``checkpoint`` of the
``model.name`` card, in the run's ``config.yaml``), the directory itself for
a Hugging Face directory, and the card's checkpoint for a card. An export
without a base (a model trained from scratch) ships the tokenizer the run
trained with (or ``--tokenizer``) and generation defaults that stop at its end
tokens.

This module also takes over fairseq2's training-time export
(``regime.export_hugging_face: true``), see
:func:`hand_over_fairseq2_hg_export`, and makes its failures loud, see
:func:`install_hg_export_failure_filter`. It runs as
``python -m qwen35_fs2.cli.export_hf`` too.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from argparse import ArgumentParser
from collections.abc import Sequence
from pathlib import Path
from typing import Final, final

import yaml
from typing_extensions import override

from fairseq2.logging import configure_logging, log

from qwen35_fs2.hf.export.checkpoint import EXPORTABLE_FAMILIES, CheckpointError, export_checkpoint
from qwen35_fs2.hf.export.repository import EXPORT_DTYPES, HfExportError
from qwen35_fs2.hf.export.writer import DEFAULT_MAX_SHARD_SIZE

_PROG: Final = "fairseq2 lm export_hf"

_SIZE: Final = re.compile(r"([0-9]+)\s*([KMG]i?B|B)?", re.IGNORECASE)

_SIZE_UNITS: Final = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}

_FAIRSEQ2_EXPORTER: Final = "fairseq2.models.utils.hg_export"

_FAIRSEQ2_CHECKPOINT_NAME: Final = re.compile(r"checkpoint_step_([0-9]+)")

# What the trainer logs when the exporter subprocess exits with an error.
_FAIRSEQ2_EXPORT_FAILURE: Final = re.compile(
    r"Hugging Face export operation of step ([0-9]+) failed\. See operation output at (.+)\."
)

_STDERR_TAIL_LINES: Final = 8


def main(argv: Sequence[str]) -> int:
    """Runs the command; returns 0 on success, 1 if the export failed and
    2 for a usage error."""
    try:
        args = _create_parser().parse_args(argv)
    except SystemExit as ex:
        return ex.code if isinstance(ex.code, int) else 2

    configure_logging(no_rich=args.no_rich)

    try:
        export_checkpoint(
            args.checkpoint,
            args.out_dir,
            step=args.step,
            base=args.base,
            no_base=args.no_base,
            tokenizer=args.tokenizer,
            dtype=None if args.dtype is None else EXPORT_DTYPES[args.dtype],
            text_only=args.text_only,
            max_shard_size=args.max_shard_size,
            force=args.force,
        )
    except (HfExportError, CheckpointError) as ex:
        log.error("Export failed: {}", ex)

        return 1
    except Exception:
        log.exception("Export failed due to an unexpected error.")

        return 1

    return 0


def _create_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog=_PROG,
        description="Exports a Qwen3.5 checkpoint as a Hugging Face repository that transformers and vLLM load in place of the base model.",
    )

    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="a fairseq2 training output directory, its checkpoints or step_N directory, a Hugging Face model directory, or an asset card name",
    )

    parser.add_argument(
        "out_dir", metavar="OUTPUT_DIR", type=Path, help="the directory to write"
    )

    parser.add_argument(
        "--step",
        type=int,
        help="the training step to export (default: the latest)",
    )

    base = parser.add_mutually_exclusive_group()

    base.add_argument(
        "--base",
        metavar="HF_DIR_OR_CARD",
        help="the Hugging Face model the checkpoint was trained from; its vision tower, MTP head, tokenizer and configuration are carried over (default: the model the run started from)",
    )

    base.add_argument(
        "--no-base",
        action="store_true",
        help="export the language model alone, as a text-only repository",
    )

    parser.add_argument(
        "--tokenizer",
        metavar="DIR_OR_CARD",
        help="without a base, the Hugging Face tokenizer to ship with the model (default: the one the run trained with)",
    )

    parser.add_argument(
        "--dtype",
        choices=list(EXPORT_DTYPES),
        help="the dtype of the tensors (default: the base model's, else the checkpoint's)",
    )

    parser.add_argument(
        "--text-only",
        action="store_true",
        help="write Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM without the vision tower",
    )

    parser.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=DEFAULT_MAX_SHARD_SIZE,
        metavar="SIZE",
        help="the largest safetensors shard, e.g. 5GB (the default), 500MB or 2GiB",
    )

    parser.add_argument(
        "--force", action="store_true", help="replace a non-empty OUTPUT_DIR"
    )

    parser.add_argument(
        "--no-rich", action="store_true", help="log plain text instead of rich text"
    )

    return parser


def parse_size(value: str) -> int:
    """Parses a size such as ``5GB`` (10^9 bytes), ``2GiB`` (2^30) or
    ``1000`` (bytes)."""
    match = _SIZE.fullmatch(value.strip())

    if match is None or int(match[1]) < 1:
        raise argparse.ArgumentTypeError(
            f"SIZE must be a positive number of bytes with an optional unit (B, KB, MB, GB, KiB, MiB, GiB), but is '{value}' instead."
        )

    return int(match[1]) * _SIZE_UNITS[(match[2] or "b").lower()]


def hand_over_fairseq2_hg_export() -> None:
    """Replaces fairseq2's out-of-process Hugging Face exporter with this
    command when it is about to export a checkpoint of ours.

    With ``regime.export_hugging_face: true`` the trainer runs ``python -m
    fairseq2.models.utils.hg_export --checkpoint-dir DIR checkpoint_step_N
    DIR/step_N/hg`` after each checkpoint, in a subprocess with an empty
    environment. fairseq2 0.8.1 gives an extension no way to change that
    command or the saver it calls (its container refuses to re-register
    either, and the saver needs a transformers 4.57 config class), so its
    process, which loads this extension, is re-executed as ``python -m
    qwen35_fs2.cli.export_hf DIR/.. DIR/step_N/hg --step N``: the same output,
    stdout, stderr and exit status reach the trainer as from fairseq2's
    exporter. Any other use of fairseq2's exporter is left alone.
    """
    main_module = sys.modules.get("__main__")

    spec = getattr(main_module, "__spec__", None)

    if spec is None or spec.name != _FAIRSEQ2_EXPORTER:
        return

    # fairseq2's own command line (`hg_export._parse_args`).
    parser = ArgumentParser(add_help=False)

    parser.add_argument("--checkpoint-dir", type=Path)
    parser.add_argument("--extra-asset-path", type=Path)
    parser.add_argument("--no-rich", action="store_true")
    parser.add_argument("model")
    parser.add_argument("save_dir", type=Path)

    args, unknown_args = parser.parse_known_args(sys.argv[1:])

    if unknown_args or args.checkpoint_dir is None or args.extra_asset_path is not None:
        return

    match = _FAIRSEQ2_CHECKPOINT_NAME.fullmatch(args.model)

    if match is None:
        return

    try:
        metadata = yaml.safe_load((args.checkpoint_dir / "model.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return

    if not isinstance(metadata, dict) or metadata.get("model_family") not in EXPORTABLE_FAMILIES:
        return

    command = [
        sys.executable, "-m", "qwen35_fs2.cli.export_hf",
        str(args.checkpoint_dir), str(args.save_dir), "--step", match[1], "--no-rich",
    ]  # fmt: skip

    print(f"fairseq2's Hugging Face exporter hands over to qwen35-fs2: {' '.join(command)}", flush=True)

    sys.stderr.flush()

    os.execv(sys.executable, command)


@final
class _HgExportFailureFilter(logging.Filter):
    """Turns fairseq2's warning that an out-of-process export failed into an
    error that carries the exporter's own message."""

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        match = _FAIRSEQ2_EXPORT_FAILURE.fullmatch(record.getMessage())

        if match is None:
            return True

        step_nr, stderr_file = match[1], match[2]

        try:
            lines = Path(stderr_file).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError as ex:
            lines = [f"(its output cannot be read: {ex})"]

        lines = [line for line in lines if line.strip()]

        # From the exporter's error message on, else the end of its output.
        error_idx = next((i for i, line in enumerate(lines) if " ERROR" in line), None)

        if error_idx is None:
            tail = lines[-_STDERR_TAIL_LINES:]
        else:
            tail = [lines[error_idx], *lines[error_idx + 1 :][-(_STDERR_TAIL_LINES - 1) :]]

        record.msg = "\n".join(
            [f"Hugging Face export of step {step_nr} FAILED; the last lines of {stderr_file}:", *(f"    {line}" for line in tail)]
        )
        record.args = ()
        record.levelno = logging.ERROR
        record.levelname = logging.getLevelName(logging.ERROR)

        return True


def install_hg_export_failure_filter() -> None:
    """Makes failed training-time exports errors in the run's log; fairseq2
    logs them as a warning that only points at a file."""
    logger = logging.getLogger("fairseq2")

    if not any(isinstance(f, _HgExportFailureFilter) for f in logger.filters):
        logger.addFilter(_HgExportFailureFilter())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
