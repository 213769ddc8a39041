from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from pathlib import Path

import pytest

from fairseq2.recipe.base import Recipe

from qwen35_fs2.cli import main as cli
from qwen35_fs2.recipes.eval_gsm8k import EvalGsm8kRecipe
from qwen35_fs2.recipes.generate import GenerateRecipe
from qwen35_fs2.recipes.sft import InstructionFinetuneRecipe
from qwen35_fs2.recipes.train import PretrainRecipe


class _Fairseq2Main:
    """Stands in for `fairseq2.recipe.cli.main`, recording its arguments."""

    def __init__(self) -> None:
        self.argv: list[str] | None = None
        self.recipe: Recipe | None = None

    def __call__(self, recipe: Recipe) -> None:
        self.argv = list(sys.argv)
        self.recipe = recipe


@pytest.fixture
def fairseq2_main(monkeypatch: pytest.MonkeyPatch) -> _Fairseq2Main:
    main = _Fairseq2Main()

    monkeypatch.setattr("fairseq2.recipe.cli.main", main)

    return main


def _write_config(tmp_path: Path, text: str) -> Path:
    file = tmp_path / "config.yaml"

    file.write_text(text, encoding="utf-8")

    return file


class TestMain:
    @pytest.mark.parametrize(
        ("command", "kls"),
        [
            ("instruction_finetune", InstructionFinetuneRecipe),
            ("train", PretrainRecipe),
            ("generate", GenerateRecipe),
            ("eval_gsm8k", EvalGsm8kRecipe),
        ],
    )
    def test_runs_the_recipe_of_each_command(self, fairseq2_main: _Fairseq2Main, command: str, kls: type[Recipe]) -> None:
        assert cli.main(["lm", command, "out"]) == 0

        assert isinstance(fairseq2_main.recipe, kls)

        assert fairseq2_main.argv == [f"fairseq2 lm {command}", "out"]

    def test_config_names_the_config_file(self, fairseq2_main: _Fairseq2Main, tmp_path: Path) -> None:
        config = _write_config(tmp_path, "regime: {num_steps: 3}\n")

        cli.main(["lm", "instruction_finetune", "--config", str(config)])

        assert fairseq2_main.argv == ["fairseq2 lm instruction_finetune", "outputs/instruction_finetune", "--config-file", str(config)]

    def test_config_file_set_and_flags_are_passed_on(self, fairseq2_main: _Fairseq2Main, tmp_path: Path) -> None:
        config = _write_config(tmp_path, "regime: {num_steps: 3}\n")

        cli.main(["lm", "train", "out", "--config-file", str(config), "--set", "a.b=1", "c=[1, 2]", "--no-rich", "--checkpoint-dir", "ckpt"])

        assert fairseq2_main.argv == [
            "fairseq2 lm train", "out", "--config-file", str(config), "--checkpoint-dir", "ckpt", "--no-rich", "--config", "a.b=1", "c=[1, 2]",
        ]  # fmt: skip

    def test_config_with_key_value_is_an_override_as_in_fairseq2(self, fairseq2_main: _Fairseq2Main) -> None:
        cli.main(["lm", "train", "out", "--config", "common.cluster=none"])

        assert fairseq2_main.argv == ["fairseq2 lm train", "out", "--config", "common.cluster=none"]

    def test_output_dir_after_set_is_the_output_dir(self, fairseq2_main: _Fairseq2Main) -> None:
        cli.main(["lm", "train", "--set", "a=1", "b=2", "out"])

        assert fairseq2_main.argv == ["fairseq2 lm train", "out", "--config", "a=1", "b=2"]

    def test_output_dir_comes_from_the_config_file_then_from_set(self, fairseq2_main: _Fairseq2Main, tmp_path: Path) -> None:
        config = _write_config(tmp_path, "output_dir: runs/from_file\n")

        cli.main(["lm", "train", "--config", str(config)])

        assert fairseq2_main.argv is not None and fairseq2_main.argv[1] == "runs/from_file"

        cli.main(["lm", "train", "--config", str(config), "--set", "output_dir=runs/from_set"])

        assert fairseq2_main.argv[1] == "runs/from_set"

        # The same directory twice is one, however it is spelled.
        cli.main(["lm", "train", "runs/from_set", "--config", str(config), "--set", "output_dir=runs/from_set"])

        assert fairseq2_main.argv[1] == "runs/from_set"

        cli.main(["lm", "train", str(Path("runs/from_set").absolute()), "--config", str(config), "--set", "output_dir=runs/from_set"])

        assert fairseq2_main.argv[1] == str(Path("runs/from_set").absolute())

    def test_rejects_an_output_dir_and_another_output_dir_override(self, fairseq2_main: _Fairseq2Main, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        # fairseq2 writes to the first and records the second in config.yaml.
        config = _write_config(tmp_path, "output_dir: runs/from_file\n")

        with pytest.raises(SystemExit) as exc_info:
            cli.main(["lm", "train", "positional", "--config", str(config), "--set", "output_dir=runs/from_set"])

        assert exc_info.value.code == 2

        assert "the output directory must be given once, but OUTPUT_DIR is 'positional' and the override of `output_dir` is 'runs/from_set'" in capsys.readouterr().err

        assert fairseq2_main.argv is None

    def test_config_takes_every_argument_after_it_as_in_fairseq2(self, fairseq2_main: _Fairseq2Main, tmp_path: Path) -> None:
        config = _write_config(tmp_path, "regime: {num_steps: 3}\n")

        # A second override was the output directory.
        cli.main(["lm", "train", "--config", str(config), "regime.num_steps=2", "regime.checkpoint_every_n_steps=1"])

        assert fairseq2_main.argv == [
            "fairseq2 lm train", "outputs/train", "--config-file", str(config), "--config", "regime.num_steps=2", "regime.checkpoint_every_n_steps=1",
        ]  # fmt: skip

        # A last argument that is neither is the output directory; a missing
        # YAML file stays a configuration file, which fairseq2 reports.
        cli.main(["lm", "train", "--config", str(config), "a=1", "runs/out"])

        assert fairseq2_main.argv == ["fairseq2 lm train", "runs/out", "--config-file", str(config), "--config", "a=1"]

        cli.main(["lm", "train", "out", "--config", str(tmp_path / "missing.yaml")])

        assert fairseq2_main.argv == ["fairseq2 lm train", "out", "--config-file", str(tmp_path / "missing.yaml")]

    def test_dump_config_needs_no_output_dir(self, fairseq2_main: _Fairseq2Main) -> None:
        cli.main(["lm", "generate", "--dump-config"])

        assert fairseq2_main.argv == ["fairseq2 lm generate", "--dump-config"]

    def test_rejects_two_config_files(self, fairseq2_main: _Fairseq2Main, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        config = _write_config(tmp_path, "regime: {num_steps: 3}\n")

        with pytest.raises(SystemExit) as exc_info:
            cli.main(["lm", "train", "out", "--config", str(config), "--config-file", str(config)])

        assert exc_info.value.code == 2

        assert "one configuration file can be given, but 2 are" in capsys.readouterr().err

        assert fairseq2_main.argv is None

    def test_rejects_an_override_inside_another_overrides_value(self, fairseq2_main: _Fairseq2Main, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as exc_info:
            cli.main(["lm", "train", "out", "--set", "lr_scheduler.config.final_lr_scale=0.5", "lr_scheduler.config={cycle_len: 100}"])

        assert exc_info.value.code == 2

        assert "an override must not set a key inside another override's value, but 'lr_scheduler.config.final_lr_scale' is inside 'lr_scheduler.config'" in capsys.readouterr().err

        assert fairseq2_main.argv is None

        # Keys side by side, or sharing a prefix of their names only, pass.
        cli.main(["lm", "train", "out", "--set", "lr_scheduler.config.final_lr_scale=0.5", "lr_scheduler.config.cycle_len=100", "lr_scheduler.name=cosine_annealing", "model.compile=true", "model.compile_options.backend=eager"])

        assert fairseq2_main.argv is not None

    def test_rejects_an_unknown_command(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as exc_info:
            cli.main(["lm", "pretrain"])

        assert exc_info.value.code == 2

        assert "invalid choice: 'pretrain'" in capsys.readouterr().err

    def test_export_hf_hands_its_arguments_to_the_export_command(self, monkeypatch: pytest.MonkeyPatch) -> None:
        received: list[Sequence[str]] = []

        def export_main(argv: Sequence[str]) -> int:
            received.append(argv)

            return 5

        module = types.ModuleType("qwen35_fs2.cli.export_hf")

        module.main = export_main  # type: ignore[attr-defined]

        monkeypatch.setitem(sys.modules, "qwen35_fs2.cli.export_hf", module)

        assert cli.main(["lm", "export_hf", "ckpt", "out", "--force"]) == 5

        # Its own help too.
        assert cli.main(["lm", "export_hf", "--help"]) == 5

        assert received == [["ckpt", "out", "--force"], ["--help"]]

    def test_export_hf_reports_a_missing_export_command(self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
        # A `None` entry makes the import fail as if the module were missing.
        monkeypatch.setitem(sys.modules, "qwen35_fs2.cli.export_hf", None)

        assert cli.main(["lm", "export_hf", "ckpt"]) == 2

        assert "`fairseq2 lm export_hf` is not available" in capsys.readouterr().err
