"""``regime.export_hugging_face`` in our recipes: the recipe takes the option
over from fairseq2, whose exporter cannot export the Qwen3.5 families, and
exports with its own; the end-to-end run is
``tests/integration/export/test_sft_export.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from fairseq2.checkpoint import CheckpointDir
from fairseq2.device import CPU
from fairseq2.gang import Gangs, create_fake_gangs
from fairseq2.recipe.base import RecipeContext
from fairseq2.recipe.config import RegimeSection
from fairseq2.runtime.dependency import DependencyContainer

from qwen35_fs2.recipes.hf_export import take_over_hf_export


def _context(regime: RegimeSection, output_dir: Path, checkpoint_dir: Path | None) -> RecipeContext:
    container = DependencyContainer()

    container.register_instance(RegimeSection, regime)
    container.register_instance(CheckpointDir, CheckpointDir(checkpoint_dir))
    container.register_instance(Path, output_dir)
    container.register_instance(Gangs, create_fake_gangs(CPU))

    return RecipeContext(container)


class TestTakeOverHfExport:
    @pytest.mark.parametrize("checkpoint_dir", [None, "elsewhere"])
    def test_turns_fairseq2s_export_off_and_exports_the_checkpoints_of_the_run(self, tmp_path: Path, checkpoint_dir: str | None) -> None:
        regime = RegimeSection(export_hugging_face=True)

        explicit_dir = None if checkpoint_dir is None else tmp_path / checkpoint_dir

        exporter = take_over_hf_export(_context(regime, tmp_path / "out", explicit_dir), lora=False)

        assert exporter is not None

        # fairseq2 creates its exporter from this section with the trainer.
        assert regime.export_hugging_face is False

        expected_dir = tmp_path / "out" / "checkpoints" if explicit_dir is None else explicit_dir

        assert exporter.command(7)[3:5] == [str(expected_dir), str(expected_dir / "step_7" / "hg")]

    def test_leaves_runs_without_export_alone(self, tmp_path: Path) -> None:
        regime = RegimeSection(export_hugging_face=False)

        assert take_over_hf_export(_context(regime, tmp_path, None), lora=False) is None

        assert regime.export_hugging_face is False
