"""The settings a resumed run restores from its checkpoints: which are
recorded, and how a difference is named. A resumption refused for them is
run in tests/integration/recipes/test_sft.py."""

from __future__ import annotations

import pytest

from fairseq2.recipe.config import CosineAnnealingLRConfig, LRSchedulerSection, MyleLRConfig, PolynomialDecayLRConfig
from fairseq2.runtime.dependency import get_dependency_resolver
from fairseq2.utils.structured import ValueConverter

from qwen35_fs2.recipes.resume import describe_differences, restored_settings
from qwen35_fs2.recipes.sft.config import InstructionFinetuneConfig


def _settings(config: InstructionFinetuneConfig) -> dict[str, object]:
    return restored_settings(config, get_dependency_resolver().resolve(ValueConverter))  # type: ignore[type-abstract]


class TestRestoredSettings:
    @pytest.mark.parametrize(
        ("scheduler", "has_num_steps"),
        [
            # The cycle is `num_steps` less the warm-up.
            (LRSchedulerSection(name="cosine_annealing", config=CosineAnnealingLRConfig()), True),
            (LRSchedulerSection(name="cosine_annealing", config=CosineAnnealingLRConfig(cycle_len=100)), False),
            (LRSchedulerSection(name="polynomial_decay", config=PolynomialDecayLRConfig()), True),
            (LRSchedulerSection(name="myle", config=MyleLRConfig()), False),
            (None, False),
        ],
        ids=["cosine", "cosine-with-cycle-len", "polynomial-decay", "myle", "none"],
    )
    def test_num_steps_where_the_schedule_derives_its_length_from_it(self, scheduler: LRSchedulerSection | None, has_num_steps: bool) -> None:
        config = InstructionFinetuneConfig()

        config.lr_scheduler = scheduler

        config.regime.num_steps = 123

        settings = _settings(config)

        assert ("regime.num_steps" in settings) == has_num_steps

        if has_num_steps:
            assert settings["regime.num_steps"] == 123

    def test_holds_the_optimizer_and_the_schedule_as_yaml_reads_them(self) -> None:
        config = InstructionFinetuneConfig()

        settings = _settings(config)

        optimizer = settings["optimizer"]

        assert isinstance(optimizer, dict)

        assert optimizer["name"] == "adamw"

        assert optimizer["config"]["lr"] == config.optimizer.config.lr  # type: ignore[attr-defined]

        # A list, as in the record read back, not the tuple of the config.
        assert optimizer["config"]["betas"] == list(config.optimizer.config.betas)  # type: ignore[attr-defined]

        assert settings["lr_scheduler"] is not None


class TestDescribeDifferences:
    def test_names_each_nested_difference_by_its_path(self) -> None:
        recorded = {"optimizer": {"name": "adamw", "config": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}}, "regime.num_steps": 100}

        given = {"optimizer": {"name": "adamw", "config": {"lr": 2e-3, "betas": [0.9, 0.99], "weight_decay": 0.1}}, "regime.num_steps": 200}

        assert describe_differences(recorded, given) == [
            "`optimizer.config.lr` must be 0.001, but is 0.002 instead",
            "`optimizer.config.betas` must be [0.9, 0.95], but is [0.9, 0.99] instead",
            "`regime.num_steps` must be 100, but is 200 instead",
        ]

    def test_names_settings_set_or_unset_since(self) -> None:
        recorded = {"lr_scheduler": {"name": "cosine_annealing"}, "regime.num_steps": 100}

        given = {"lr_scheduler": None, "optimizer": {"name": "adamw"}}

        assert describe_differences(recorded, given) == [
            "`lr_scheduler` must be {'name': 'cosine_annealing'}, but is None instead",
            "`regime.num_steps` must be 100, but is not set",
            "`optimizer` must not be set, but is {'name': 'adamw'}",
        ]

    def test_equal_settings_have_no_difference(self) -> None:
        settings = {"optimizer": {"name": "adamw", "config": {"lr": 1e-3}}, "lr_scheduler": None}

        assert describe_differences(settings, settings) == []
