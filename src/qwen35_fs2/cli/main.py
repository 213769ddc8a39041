"""The ``fairseq2`` command (alias ``qwen35-fs2``): ``fairseq2 lm <recipe>``.

fairseq2 0.8.1 installs no command of its own. This one runs our recipes
through :func:`fairseq2.recipe.cli.main`, with these arguments::

    fairseq2 lm <recipe> [OUTPUT_DIR] [--config FILE] [--set KEY=VALUE ...]
                         [--dump-config] [--no-rich] [--checkpoint-dir DIR]

- ``--config FILE`` (or ``--config-file FILE``) is the YAML configuration,
  merged over the recipe's defaults. ``--config KEY=VALUE ...``, fairseq2's
  own meaning of the option, takes overrides like ``--set KEY=VALUE ...``;
  both take every argument after them, a last one that is neither an
  override nor a configuration file being the output directory.
- ``OUTPUT_DIR`` defaults to the ``output_dir`` of the configuration, and
  otherwise to ``outputs/<recipe>``. Running a recipe again with the same output
  directory and configuration resumes from its last checkpoint.
- ``fairseq2 lm export_hf ...`` hands its arguments to
  :func:`qwen35_fs2.cli.export_hf.main`.

Every recipe also runs as ``python -m qwen35_fs2.recipes.<module>`` with the
same arguments, and so under ``torchrun``.
"""

from __future__ import annotations

import logging
import re
import sys
from argparse import ArgumentParser, Namespace
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Final, final
from unittest import mock

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError
from typing_extensions import override

from fairseq2.recipe.base import Recipe
from fairseq2.recipe.error import RecipeConfigParseError

LM_GROUP: Final = "lm"

EXPORT_HF_COMMAND: Final = "export_hf"

_FIELD_ERROR_RE: Final = re.compile(r"^`(\w+)` field cannot be structured\.$")


@final
@dataclass(frozen=True)
class RecipeCommand:
    name: str

    module: str
    """The module of the recipe class; also runnable with ``python -m``."""

    recipe_kls: str

    help: str

    def load_recipe(self) -> Recipe:
        kls: Callable[[], Recipe] = getattr(import_module(self.module), self.recipe_kls)

        return kls()


RECIPE_COMMANDS: Final = (
    RecipeCommand(
        "instruction_finetune",
        "qwen35_fs2.recipes.sft",
        "InstructionFinetuneRecipe",
        "supervised fine-tuning on instruction data (GSM8K) in the Qwen3.5 chat format",
    ),
    RecipeCommand(
        "train",
        "qwen35_fs2.recipes.train",
        "PretrainRecipe",
        "continued pretraining on parquet text shards (FineWeb-Edu)",
    ),
    RecipeCommand(
        "generate",
        "qwen35_fs2.recipes.generate",
        "GenerateRecipe",
        "chat responses to the prompts of a file",
    ),
    RecipeCommand(
        "eval_gsm8k",
        "qwen35_fs2.recipes.eval_gsm8k",
        "EvalGsm8kRecipe",
        "greedy GSM8K answers and their exact-match accuracy",
    ),
)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``fairseq2 <group> <command> ...`` and returns the exit code."""
    if argv is None:
        argv = sys.argv[1:]

    # The export command parses its own arguments, `--help` included.
    if list(argv[:2]) == [LM_GROUP, EXPORT_HF_COMMAND]:
        return _run_export_hf(argv[2:])

    parser = ArgumentParser(
        prog="fairseq2", description="Qwen3.5 recipes for fairseq2."
    )

    groups = parser.add_subparsers(dest="group", metavar="GROUP", required=True)

    lm_parser = groups.add_parser(LM_GROUP, help="language-model recipes")

    commands = lm_parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    for command in RECIPE_COMMANDS:
        _add_recipe_arguments(commands.add_parser(command.name, help=command.help))

    # Listed for `--help`; dispatched above.
    commands.add_parser(EXPORT_HF_COMMAND, help="export a checkpoint to the Hugging Face format")

    args = parser.parse_args(argv)

    command = next(c for c in RECIPE_COMMANDS if c.name == args.command)

    return _run_recipe(command, args, parser)


def _add_recipe_arguments(parser: ArgumentParser) -> None:
    parser.add_argument(
        "output_dir",
        type=Path,
        nargs="?",
        metavar="OUTPUT_DIR",
        help="directory of the logs, metrics and checkpoints (default: `output_dir` of the configuration, or outputs/<recipe>)",
    )

    parser.add_argument(
        "--config",
        dest="config_args",
        metavar="FILE|KEY=VALUE",
        nargs="+",
        action="extend",
        default=[],
        help="the YAML configuration file and KEY=VALUE overrides (as with --set); as fairseq2's option, it takes every argument after it",
    )

    parser.add_argument(
        "--config-file",
        type=Path,
        metavar="FILE",
        help="the YAML configuration file",
    )

    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        nargs="+",
        action="extend",
        default=[],
        help="configuration overrides; VALUE is YAML, e.g. --set regime.num_steps=100 'dataset.train=[{path: data/train.jsonl}]'",
    )

    parser.add_argument(
        "--dump-config",
        action="store_true",
        help="print the merged configuration and exit",
    )

    parser.add_argument(
        "--no-rich",
        action="store_true",
        help="log plain text, without progress bars",
    )

    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        metavar="DIR",
        help="directory of the checkpoints (default: OUTPUT_DIR/checkpoints)",
    )

    parser.add_argument(
        "--no-exit-on-error",
        action="store_true",
        help="raise errors instead of logging them and exiting",
    )


def _run_recipe(command: RecipeCommand, args: Namespace, parser: ArgumentParser) -> int:
    config_files = [] if args.config_file is None else [args.config_file]

    overrides = []

    config_args = list(args.config_args)

    # `--config` takes every argument after it; a last one that is neither an
    # override nor a configuration file is the output directory.
    if args.output_dir is None and config_args and _is_output_dir_arg(config_args[-1]):
        args.output_dir = Path(config_args.pop())

    for item in config_args:
        if "=" in item and not Path(item).is_file():
            overrides.append(item)
        else:
            config_files.append(Path(item))

    overrides.extend(args.overrides)

    # So does `--set`.
    if args.output_dir is None and overrides and "=" not in overrides[-1]:
        args.output_dir = Path(overrides.pop())

    if len(config_files) > 1:
        parser.error(
            f"one configuration file can be given, but {len(config_files)} are: {', '.join(map(str, config_files))}"
        )

    config_file = config_files[0] if config_files else None

    for item in overrides:
        if "=" not in item:
            parser.error(f"overrides must be KEY=VALUE, but '{item}' is not")

    _check_nested_overrides(overrides, parser)

    # fairseq2 writes to OUTPUT_DIR and records the override in config.yaml.
    if args.output_dir is not None:
        override_dir = _override_output_dir(overrides, parser)

        if override_dir is not None and _normalized(override_dir) != _normalized(args.output_dir):
            parser.error(
                f"the output directory must be given once, but OUTPUT_DIR is '{args.output_dir}' and the override of `output_dir` is '{override_dir}'; fairseq2 would write to the first and record the second in config.yaml"
            )

    fairseq2_argv = [f"fairseq2 {LM_GROUP} {command.name}"]

    if not args.dump_config:
        output_dir = args.output_dir

        if output_dir is None:
            output_dir = _find_output_dir(config_file, overrides, parser)

        if output_dir is None:
            output_dir = Path("outputs", command.name)

        fairseq2_argv.append(str(output_dir))

    if config_file is not None:
        fairseq2_argv += ["--config-file", str(config_file)]

    if args.checkpoint_dir is not None:
        fairseq2_argv += ["--checkpoint-dir", str(args.checkpoint_dir)]

    for flag in ("dump_config", "no_rich", "no_exit_on_error"):
        if getattr(args, flag):
            fairseq2_argv.append("--" + flag.replace("_", "-"))

    # fairseq2's `--config` takes every argument after it.
    if overrides:
        fairseq2_argv += ["--config", *overrides]

    recipe = command.load_recipe()

    from fairseq2.recipe.cli import main as fairseq2_main

    # fairseq2 logs a configuration error as a long traceback; a summary
    # naming the key follows it.
    error_catcher = _ConfigErrorCatcher()

    fairseq2_logger = logging.getLogger("fairseq2")

    fairseq2_logger.addHandler(error_catcher)

    try:
        # `fairseq2.recipe.cli.main` parses `sys.argv` and exits on errors.
        with mock.patch.object(sys, "argv", fairseq2_argv):
            fairseq2_main(recipe)
    except SystemExit:
        if error_catcher.summary is not None:
            print(f"fairseq2: error: {error_catcher.summary}", file=sys.stderr)

        raise
    finally:
        fairseq2_logger.removeHandler(error_catcher)

    return 0


def _check_nested_overrides(overrides: list[str], parser: ArgumentParser) -> None:
    """Refuses an override of a key inside another override's value.

    fairseq2 0.8.1 collects the overrides into one nested mapping and sets
    ``a.b={...}`` after the keys under ``a.b``, whatever their order on the
    command line: ``a.b.c=1`` beside it would be dropped without a word.
    """
    keys = [item.split("=", 1)[0].strip().removeprefix("set:") for item in overrides if not item.strip().startswith("del:")]

    for outer in keys:
        for inner in keys:
            if inner.startswith(f"{outer}."):
                parser.error(
                    f"an override must not set a key inside another override's value, but '{inner}' is inside '{outer}', which would replace it whatever their order; "
                    f"give '{inner.removeprefix(outer + '.')}' in the value of '{outer}' instead"
                )


@final
class _ConfigErrorCatcher(logging.Handler):
    """Summarizes the configuration error that fairseq2 logs, if any."""

    summary: str | None = None

    @override
    def emit(self, record: logging.LogRecord) -> None:
        # fairseq2 logs with `exc_info=True` from inside the `except` block.
        exc_info: object = record.exc_info

        if exc_info is True:
            exc_info = sys.exc_info()

        if not isinstance(exc_info, tuple):
            return

        ex = exc_info[1]

        if isinstance(ex, RecipeConfigParseError):
            self.summary = _summarize_config_error(ex)


def _summarize_config_error(ex: BaseException) -> str:
    """Returns the key path and the innermost reason of a configuration
    error, e.g. "`dataset`: ... contains extra key(s) trian."."""
    keys = []

    reasons = [str(ex)]

    cause = ex.__cause__

    while cause is not None:
        match = _FIELD_ERROR_RE.match(str(cause))

        if match is not None:
            keys.append(match[1])
        else:
            reasons.append(str(cause))

        cause = cause.__cause__

    if not keys:
        # The outermost and the innermost reasons, once each.
        return " ".join(dict.fromkeys([reasons[0], reasons[-1]]))

    return f"the configuration is invalid at `{'.'.join(keys)}`: {' '.join(reasons[-2:])}"


def _normalized(path: Path) -> Path:
    """``path`` as fairseq2 takes an output directory: ``~`` expanded, made
    absolute (links are kept)."""
    return path.expanduser().absolute()


def _is_output_dir_arg(item: str) -> bool:
    """Whether ``item``, the last argument of ``--config``, is the output
    directory: neither an override nor a configuration file (an existing
    file, or a name of a YAML file, which is an error if it is missing)."""
    path = Path(item)

    return "=" not in item and not path.is_file() and path.suffix not in (".yaml", ".yml")


def _find_output_dir(
    config_file: Path | None, overrides: Sequence[str], parser: ArgumentParser
) -> Path | None:
    """Returns the last ``output_dir`` of the overrides, or else of the
    configuration file."""
    output_dir = _override_output_dir(overrides, parser)

    if output_dir is not None:
        return output_dir

    yaml = YAML(typ="safe", pure=True)

    if config_file is None or not config_file.is_file():
        # fairseq2 reports a missing file.
        return None

    try:
        documents = list(yaml.load_all(config_file.read_text(encoding="utf-8")))
    except (OSError, YAMLError):
        # fairseq2 reports an unreadable file.
        return None

    if not documents or not isinstance(documents[0], dict):
        return None

    return _as_output_dir(documents[0].get("output_dir"), str(config_file), parser)


def _override_output_dir(overrides: Sequence[str], parser: ArgumentParser) -> Path | None:
    """Returns the last ``output_dir`` of the overrides, if any."""
    yaml = YAML(typ="safe", pure=True)

    for item in reversed(overrides):
        key, value = item.split("=", maxsplit=1)

        if key.strip().removeprefix("set:") == "output_dir":
            try:
                return _as_output_dir(yaml.load(value.strip()), "--set output_dir", parser)
            except YAMLError:
                parser.error(f"output_dir must be a path, but is '{value}'")

    return None


def _as_output_dir(value: object, origin: str, parser: ArgumentParser) -> Path | None:
    if value is None:
        return None

    if not isinstance(value, str):
        parser.error(f"`output_dir` of {origin} must be a path, but is {value!r}")

    return Path(value)


def _run_export_hf(argv: Sequence[str]) -> int:
    try:
        export_cli = import_module("qwen35_fs2.cli.export_hf")
    except ModuleNotFoundError as ex:
        if ex.name != "qwen35_fs2.cli.export_hf":
            raise

        print(
            "fairseq2: error: `fairseq2 lm export_hf` is not available in this installation (qwen35_fs2.cli.export_hf is missing).",
            file=sys.stderr,
        )

        return 2

    ret: int = export_cli.main(argv)

    return ret
