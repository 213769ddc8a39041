"""``fairseq2 lm export_hf``: exports a Qwen3.5 checkpoint as a Hugging Face
repository.

::

    fairseq2 lm export_hf CHECKPOINT OUTPUT_DIR [--step N] [--base HF_DIR_OR_CARD | --no-base]
                          [--tokenizer DIR_OR_CARD] [--dtype {bfloat16,float16,float32}]
                          [--text-only] [--max-shard-size SIZE] [--adapter | --merge]
                          [--force] [--no-rich]

``CHECKPOINT`` is a fairseq2 training output directory (its latest step, or
``--step N``), its ``checkpoints`` directory, a ``step_N`` directory, a Hugging
Face model directory, or an asset card name. Without ``--base`` the base is
the model the run started from (``model.path``, or the ``checkpoint`` of the
``model.name`` card, in the run's ``config.yaml``), the directory itself for
a Hugging Face directory, and the card's checkpoint for a card. An export
without a base (a model trained from scratch) ships the tokenizer the run
trained with (or ``--tokenizer``) and generation defaults that stop at its end
tokens.

The checkpoint of a LoRA run (one with a ``lora`` section) is exported with
``--adapter``, as a PEFT adapter directory (``adapter_config.json``,
``adapter_model.safetensors``) whose ``base_model_name_or_path`` is the base,
or with ``--merge``, as a whole model with the adapters merged into its
weights in float32 and then cast to the export dtype.

It runs as ``python -m qwen35_fs2.cli.export_hf`` too, which is how the
recipes export their checkpoints during training
(:mod:`qwen35_fs2.hf.export.training`).
"""

from __future__ import annotations

import argparse
import re
import sys
from argparse import ArgumentParser
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from fairseq2.logging import configure_logging, log

from qwen35_fs2.hf.export.checkpoint import CheckpointError, export_checkpoint
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
            run_dir=args.run_dir,
            base=args.base,
            no_base=args.no_base,
            tokenizer=args.tokenizer,
            dtype=None if args.dtype is None else EXPORT_DTYPES[args.dtype],
            text_only=args.text_only,
            keep_base_mtp=args.keep_base_mtp,
            max_shard_size=args.max_shard_size,
            force=args.force,
            adapter=args.adapter,
            merge=args.merge,
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
        "--run-dir",
        type=Path,
        metavar="DIR",
        help="the output directory of the training run, whose config.yaml records the model it started from and its tokenizer (default: the directory above the checkpoints; give it for checkpoints written elsewhere with --checkpoint-dir)",
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
        help="the Hugging Face model the checkpoint was trained from; its vision tower, tokenizer, generation defaults and configuration are carried over, and its MTP head where the checkpoint has none or with --keep-base-mtp (default: the model the run started from)",
    )

    base.add_argument(
        "--no-base",
        action="store_true",
        help="export the language model alone, as a text-only repository",
    )

    parser.add_argument(
        "--tokenizer",
        metavar="DIR_OR_CARD",
        help="without a base, or with a base that holds no tokenizer, the Hugging Face tokenizer to ship with the model (default: the one the run trained with)",
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
        "--keep-base-mtp",
        action="store_true",
        help="carry the base model's MTP head over as it is, instead of the checkpoint's (trained with the model)",
    )

    parser.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=DEFAULT_MAX_SHARD_SIZE,
        metavar="SIZE",
        help="the largest safetensors shard, e.g. 5GB (the default), 500MB or 2GiB",
    )

    lora = parser.add_mutually_exclusive_group()

    lora.add_argument(
        "--adapter",
        action="store_true",
        help="for a LoRA run: write its adapters as a PEFT adapter directory for the base",
    )

    lora.add_argument(
        "--merge",
        action="store_true",
        help="for a LoRA run: write the model with its adapters merged (in float32, then cast to the export dtype)",
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
