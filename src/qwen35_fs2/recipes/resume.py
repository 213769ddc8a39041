"""The settings that a resumed run takes from its checkpoints instead of its
configuration, recorded when the run starts and checked when it resumes.

fairseq2 resumes a run by restoring its optimizer and learning-rate
scheduler from the last checkpoint, state and settings together: PyTorch's
``Optimizer.load_state_dict`` replaces the learning rate, betas and weight
decay of every parameter group with the saved ones, and the scheduler's
saved state holds its own base learning rates and, for the schedules that
derive their length from ``regime.num_steps``, that length. A run started
again with another ``optimizer.config.lr``, ``lr_scheduler`` or a longer
``regime.num_steps`` (the cosine schedule then restarts its cycle where the
old run ended) would train with the old settings, or a schedule of neither,
without a word; and fairseq2 rewrites ``config.yaml`` with the new ones
first. Our recipes set ``common.no_sweep_dir``, so a changed configuration
lands in the same output directory and resumes.

A new run records these settings in ``restored_config.yaml`` in its
checkpoint directory (:func:`check_restored_config`); a resumed run whose
settings differ stops with an error naming each difference.
"""

from __future__ import annotations

from typing import Final, Protocol

import yaml

from fairseq2.logging import log
from fairseq2.recipe.base import RecipeContext
from fairseq2.recipe.config import (
    COSINE_ANNEALING_LR,
    POLYNOMIAL_DECAY_LR,
    TRI_STAGE_LR,
    LRSchedulerSection,
    OptimizerSection,
    RegimeSection,
)
from fairseq2.recipe.error import RecipeError
from fairseq2.utils.structured import ValueConverter

from qwen35_fs2.recipes.checkpoint_dir import get_checkpoint_dir
from qwen35_fs2.records import write_record

RESTORED_CONFIG_FILE: Final = "restored_config.yaml"
"""The record of a run's restored settings, in its checkpoint directory."""


class RestoredConfig(Protocol):
    """The sections of a training recipe's configuration that a resumed run
    restores from its checkpoints."""

    optimizer: OptimizerSection

    lr_scheduler: LRSchedulerSection | None

    regime: RegimeSection


def restored_settings(config: RestoredConfig, value_converter: ValueConverter) -> dict[str, object]:
    """Returns the settings of ``config`` that a resumed run takes from its
    checkpoints, by their paths in the configuration: ``optimizer``,
    ``lr_scheduler``, and ``regime.num_steps`` where the schedule's length
    is derived from it (fairseq2 0.8.1's cosine schedule without a
    ``cycle_len``, its polynomial decay and tri-stage schedules)."""
    settings: dict[str, object] = {
        "optimizer": value_converter.unstructure(config.optimizer),
        "lr_scheduler": value_converter.unstructure(config.lr_scheduler),
    }

    scheduler = config.lr_scheduler

    if scheduler is not None:
        if scheduler.name in (POLYNOMIAL_DECAY_LR, TRI_STAGE_LR) or (
            scheduler.name == COSINE_ANNEALING_LR and getattr(scheduler.config, "cycle_len", None) is None
        ):
            settings["regime.num_steps"] = config.regime.num_steps

    # As YAML reads them back: lists, not tuples.
    return yaml.safe_load(yaml.safe_dump(settings, sort_keys=False))  # type: ignore[no-any-return]


def check_restored_config(context: RecipeContext, config: RestoredConfig) -> None:
    """Records the restored settings of ``config`` when the run is new, and
    checks them against the record when it resumes.

    :raises RecipeError: if a resumed run's settings differ from the
        recorded ones.
    """
    settings = restored_settings(config, context.resolver.resolve(ValueConverter))  # type: ignore[type-abstract]

    checkpoint_dir = get_checkpoint_dir(context)

    file = checkpoint_dir / RESTORED_CONFIG_FILE

    if not context.get_checkpoint_manager().has_checkpoint(exclude_model_only=True):
        if context.gangs.root.rank == 0:
            write_record(file, settings)

        return

    try:
        recorded = yaml.safe_load(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        log.warning("The checkpoints in {} have no record of the optimizer and learning-rate settings they were trained with ({}): a resumption with other settings cannot be detected, and would train with the checkpoints' own.", checkpoint_dir, RESTORED_CONFIG_FILE)  # fmt: skip

        return
    except (OSError, yaml.YAMLError) as ex:
        raise RecipeError(f"{file} cannot be read: {ex}") from None

    if not isinstance(recorded, dict):
        raise RecipeError(f"{file} must hold a mapping of settings, but does not.")

    differences = describe_differences(recorded, settings)

    if differences:
        raise RecipeError(
            f"A resumed run must have the optimizer and learning-rate settings its checkpoints in {checkpoint_dir} were trained with, which it restores from them, but: {'; '.join(differences)}. "
            "Set them back to resume the run, or start a new run in another output directory from this run's model "
            "(`model.name=checkpoint_step_N common.assets.prev_checkpoint_dir=<this run>/checkpoints`; for a LoRA run, its checkpoint exported with `fairseq2 lm export_hf --merge` as `model.path`)."
        )


def describe_differences(recorded: dict[str, object], given: dict[str, object], prefix: str = "") -> list[str]:
    """Returns the differences of ``given`` from ``recorded``, one for each
    setting by its dotted path (``optimizer.config.lr``), nested mappings
    compared key by key."""
    differences = []

    for name in [*recorded, *(name for name in given if name not in recorded)]:
        path = f"{prefix}{name}"

        if name not in given:
            differences.append(f"`{path}` must be {recorded[name]!r}, but is not set")
        elif name not in recorded:
            differences.append(f"`{path}` must not be set, but is {given[name]!r}")
        else:
            old, new = recorded[name], given[name]

            if isinstance(old, dict) and isinstance(new, dict):
                differences.extend(describe_differences(old, new, f"{path}."))
            elif old != new:
                differences.append(f"`{path}` must be {old!r}, but is {new!r} instead")

    return differences
