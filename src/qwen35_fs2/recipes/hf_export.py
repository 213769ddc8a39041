"""``regime.export_hugging_face: true`` in our training recipes: after every
checkpoint, the recipe's own exporter (:class:`HfCheckpointExporter`) runs
``fairseq2 lm export_hf`` on it, instead of fairseq2's exporter, which cannot
export the Qwen3.5 families.

fairseq2 0.8.1 lets a recipe replace neither its exporter nor the command it
runs (the dependency container refuses a second registration), but it
creates its exporter from the regime section when the trainer is created,
and runs hooks after every checkpoint (:meth:`Trainer.register_checkpoint_save_hook`).
So the recipe takes the option over before creating the trainer
(:func:`take_over_hf_export`), and hooks its exporter into the trainer
(:func:`export_hf_checkpoints`). The run's ``config.yaml``, written before,
keeps the option as the user set it.
"""

from __future__ import annotations

from typing import final

from typing_extensions import override

from fairseq2.recipe.base import RecipeContext
from fairseq2.recipe.config import RegimeSection
from fairseq2.task import Task
from fairseq2.trainer import Trainer, TrainStepHookArgs

from qwen35_fs2.hf.export.training import HfCheckpointExporter
from qwen35_fs2.recipes.checkpoint_dir import get_checkpoint_dir


def take_over_hf_export(context: RecipeContext, *, lora: bool) -> HfCheckpointExporter | None:
    """Returns the exporter of the run if its regime asks for Hugging Face
    exports, having turned fairseq2's own off; ``None`` otherwise. Call it
    before :meth:`RecipeContext.create_trainer`.

    :param lora: If ``True``, the run trains LoRA adapters, which are
        exported as a PEFT adapter directory.
    """
    regime = context.resolver.resolve(RegimeSection)

    if not regime.export_hugging_face:
        return None

    regime.export_hugging_face = False

    return HfCheckpointExporter(get_checkpoint_dir(context), context.gangs, run_dir=context.output_dir, adapter=lora)


def export_hf_checkpoints(trainer: Trainer, exporter: HfCheckpointExporter) -> Task:
    """Makes ``exporter`` export every checkpoint ``trainer`` saves; returns
    the task to run, which waits for the last export before it ends."""

    def export(args: TrainStepHookArgs) -> None:
        exporter.export(args.step_nr)

    trainer.register_checkpoint_save_hook(export)

    return _ExportingTrainer(trainer, exporter)


@final
class _ExportingTrainer(Task):
    """Runs ``trainer``, then waits for the export of its last checkpoint,
    which runs in the background like the others."""

    def __init__(self, trainer: Trainer, exporter: HfCheckpointExporter) -> None:
        self._trainer = trainer
        self._exporter = exporter

    @override
    def run(self) -> None:
        try:
            self._trainer.run()
        finally:
            self._exporter.close()

    @override
    def request_stop(self) -> None:
        self._trainer.request_stop()

    @property
    @override
    def step_nr(self) -> int:
        return self._trainer.step_nr

    @override
    def close(self) -> None:
        self._trainer.close()
