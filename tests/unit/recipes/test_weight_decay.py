"""The AdamW parameter groups of `lm train` and `lm instruction_finetune`:
exactly which parameters get no weight decay, through fairseq2's own
`prepare_parameter_groups` and configuration merging."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from fairseq2.models.transformer_lm import apply_ac_to_transformer_lm
from fairseq2.recipe.config import AdamWConfig
from fairseq2.recipe.optim import prepare_parameter_groups
from torch.nn import Linear, Module, Parameter

from qwen35_fs2.models.qwen35.config import tiny_qwen35_config
from qwen35_fs2.models.qwen35.factory import create_qwen35_model
from qwen35_fs2.models.qwen35_moe.config import tiny_qwen35_moe_config
from qwen35_fs2.models.qwen35_moe.factory import create_qwen35_moe_model
from qwen35_fs2.recipes.optim import NO_WEIGHT_DECAY_PARAMS
from qwen35_fs2.recipes.sft.config import InstructionFinetuneConfig
from qwen35_fs2.recipes.train.config import PretrainConfig

from recipes_testing import dump_config, read_recipe_file

# `tiny_qwen35_config`: 4 layers, Gated DeltaNet in 0-2, full attention in 3,
# tied embeddings.
DENSE_NO_DECAY = [
    "decoder_frontend.embed.weight",
    "decoder.layers.0.self_attn_layer_norm.weight",
    "decoder.layers.0.linear_attn.conv1d.weight",
    "decoder.layers.0.linear_attn.decay.A_log",
    "decoder.layers.0.linear_attn.decay.dt_bias",
    "decoder.layers.0.linear_attn.norm.weight",
    "decoder.layers.0.ffn_layer_norm.weight",
    "decoder.layers.1.self_attn_layer_norm.weight",
    "decoder.layers.1.linear_attn.conv1d.weight",
    "decoder.layers.1.linear_attn.decay.A_log",
    "decoder.layers.1.linear_attn.decay.dt_bias",
    "decoder.layers.1.linear_attn.norm.weight",
    "decoder.layers.1.ffn_layer_norm.weight",
    "decoder.layers.2.self_attn_layer_norm.weight",
    "decoder.layers.2.linear_attn.conv1d.weight",
    "decoder.layers.2.linear_attn.decay.A_log",
    "decoder.layers.2.linear_attn.decay.dt_bias",
    "decoder.layers.2.linear_attn.norm.weight",
    "decoder.layers.2.ffn_layer_norm.weight",
    "decoder.layers.3.self_attn_layer_norm.weight",
    "decoder.layers.3.self_attn.q_norm.weight",
    "decoder.layers.3.self_attn.k_norm.weight",
    "decoder.layers.3.ffn_layer_norm.weight",
    "decoder.layer_norm.weight",
]

# `tiny_qwen35_moe_config`: the same layers with MoE blocks. The router, the
# experts, the shared expert and its gate are projections and decay; so does
# the untied output projection `final_proj.weight`.
MOE_NO_DECAY = [
    "decoder_frontend.embed.weight",
    "decoder.layers.0.self_attn_layer_norm.weight",
    "decoder.layers.0.linear_attn.conv1d.weight",
    "decoder.layers.0.linear_attn.decay.A_log",
    "decoder.layers.0.linear_attn.decay.dt_bias",
    "decoder.layers.0.linear_attn.norm.weight",
    "decoder.layers.0.ffn_layer_norm.weight",
    "decoder.layers.1.self_attn_layer_norm.weight",
    "decoder.layers.1.linear_attn.conv1d.weight",
    "decoder.layers.1.linear_attn.decay.A_log",
    "decoder.layers.1.linear_attn.decay.dt_bias",
    "decoder.layers.1.linear_attn.norm.weight",
    "decoder.layers.1.ffn_layer_norm.weight",
    "decoder.layers.2.self_attn_layer_norm.weight",
    "decoder.layers.2.linear_attn.conv1d.weight",
    "decoder.layers.2.linear_attn.decay.A_log",
    "decoder.layers.2.linear_attn.decay.dt_bias",
    "decoder.layers.2.linear_attn.norm.weight",
    "decoder.layers.2.ffn_layer_norm.weight",
    "decoder.layers.3.self_attn_layer_norm.weight",
    "decoder.layers.3.self_attn.q_norm.weight",
    "decoder.layers.3.self_attn.k_norm.weight",
    "decoder.layers.3.ffn_layer_norm.weight",
    "decoder.layer_norm.weight",
]

AC_WRAPPER = "_checkpoint_wrapped_module."

TRAINING_RECIPES = {"instruction_finetune": InstructionFinetuneConfig, "train": PretrainConfig}

# The training configs of `recipes/` and their recipes.
TRAINING_FILES = {
    "qwen35_0.8b_gsm8k.yaml": "instruction_finetune",
    "qwen35_0.8b_fineweb_edu.yaml": "train",
    "qwen35_tiny_gsm8k_cpu.yaml": "instruction_finetune",
    "qwen35_tiny_pretrain_cpu.yaml": "train",
}


def _split_by_decay(model: Module, config: AdamWConfig) -> tuple[list[str], list[str]]:
    """Returns the names of the parameters that the optimizer built from
    ``config`` does not decay, and of those it decays, in model order."""
    groups = prepare_parameter_groups(model, config.groups)

    weight_decay: dict[int, float] = {}

    for group in groups:
        assert isinstance(group, dict), "the config must define parameter groups"

        for param in group["params"]:  # type: ignore[attr-defined]
            weight_decay[id(param)] = group.get("weight_decay", config.weight_decay)  # type: ignore[assignment]

    names = [(name, weight_decay[id(param)]) for name, param in model.named_parameters()]

    return [n for n, wd in names if wd == 0.0], [n for n, wd in names if wd != 0.0]


def _adamw(config_kls: type[Any]) -> AdamWConfig:
    config = config_kls().optimizer.config

    assert isinstance(config, AdamWConfig)

    return config


@pytest.mark.parametrize("recipe", sorted(TRAINING_RECIPES))
class TestDefaultParameterGroups:
    def test_dense_model_decays_all_but_the_listed_parameters(self, recipe: str) -> None:
        with torch.device("meta"):
            model = create_qwen35_model(tiny_qwen35_config())

        config = _adamw(TRAINING_RECIPES[recipe])

        assert config.weight_decay == 0.1

        no_decay, decay = _split_by_decay(model, config)

        assert no_decay == DENSE_NO_DECAY

        assert len(no_decay) + len(decay) == len(list(model.parameters()))

    def test_mtp_head_decays_its_projections_only(self, recipe: str) -> None:
        config = tiny_qwen35_config()

        config.mtp_num_layers = 1

        with torch.device("meta"):
            model = create_qwen35_model(config)

        no_decay, decay = _split_by_decay(model, _adamw(TRAINING_RECIPES[recipe]))

        assert [n for n in no_decay if n.startswith("mtp.")] == [
            "mtp.pre_fc_norm_embedding.weight",
            "mtp.pre_fc_norm_hidden.weight",
            "mtp.layers.0.self_attn_layer_norm.weight",
            "mtp.layers.0.self_attn.q_norm.weight",
            "mtp.layers.0.self_attn.k_norm.weight",
            "mtp.layers.0.ffn_layer_norm.weight",
            "mtp.layer_norm.weight",
        ]

        assert "mtp.fc.weight" in decay

    def test_moe_model_decays_all_but_the_listed_parameters(self, recipe: str) -> None:
        with torch.device("meta"):
            model = create_qwen35_moe_model(tiny_qwen35_moe_config())

        no_decay, decay = _split_by_decay(model, _adamw(TRAINING_RECIPES[recipe]))

        assert no_decay == MOE_NO_DECAY

        assert "final_proj.weight" in decay and "decoder.layers.0.ffn.router.weight" in decay

    def test_activation_checkpointing_wrappers_do_not_change_the_groups(self, recipe: str) -> None:
        with torch.device("meta"):
            model = create_qwen35_model(tiny_qwen35_config())

        wrapped = apply_ac_to_transformer_lm(copy.deepcopy(model), every_nth_layer=1)

        no_decay, _ = _split_by_decay(wrapped, _adamw(TRAINING_RECIPES[recipe]))

        # The wrapper is in the names, and the same parameters get no decay.
        assert sum(AC_WRAPPER in name for name in no_decay) == len(DENSE_NO_DECAY) - 2

        assert [name.replace(AC_WRAPPER, "") for name in no_decay] == DENSE_NO_DECAY

    def test_decay_parameters_in_a_submodule_and_biases_get_no_decay(self, recipe: str) -> None:
        # `A_log` and `dt_bias` may move into a submodule of the Gated
        # DeltaNet layer; the tiny models have no biases.
        linear_attn = Module()

        linear_attn.decay = Module()

        linear_attn.decay.A_log = Parameter(torch.zeros(4))
        linear_attn.decay.dt_bias = Parameter(torch.zeros(4))

        linear_attn.in_proj_a = Linear(8, 4, bias=True)

        layer = Module()

        layer.linear_attn = linear_attn

        no_decay, decay = _split_by_decay(layer, _adamw(TRAINING_RECIPES[recipe]))

        assert no_decay == ["linear_attn.decay.A_log", "linear_attn.decay.dt_bias", "linear_attn.in_proj_a.bias"]

        assert decay == ["linear_attn.in_proj_a.weight"]


class TestParameterGroupsInConfigFiles:
    @pytest.mark.parametrize("name", sorted(TRAINING_FILES))
    def test_shipped_training_configs_show_the_default_group(self, name: str) -> None:
        optimizer = read_recipe_file(name)["optimizer"]["config"]

        assert optimizer["groups"] == [{"params": list(NO_WEIGHT_DECAY_PARAMS), "weight_decay": 0.0}]

        assert optimizer["weight_decay"] > 0.0

    @pytest.mark.parametrize("recipe", sorted(TRAINING_RECIPES))
    def test_a_file_without_groups_keeps_the_default_group(self, capfd: pytest.CaptureFixture[str], tmp_path: Path, recipe: str) -> None:
        config_file = tmp_path / "config.yaml"

        config_file.write_text("optimizer:\n  name: adamw\n  config:\n    lr: 2.0e-5\n    weight_decay: 0.05\n")

        optimizer = dump_config(capfd, recipe, "--config", str(config_file))["optimizer"]["config"]

        # (PyYAML reads the dumped `2e-05` as a string.)
        assert (float(optimizer["lr"]), optimizer["weight_decay"]) == (2.0e-5, 0.05)

        assert [group["params"] for group in optimizer["groups"]] == [list(NO_WEIGHT_DECAY_PARAMS)]

        assert optimizer["groups"][0]["weight_decay"] == 0.0

    @pytest.mark.parametrize("recipe", sorted(TRAINING_RECIPES))
    def test_a_file_with_groups_replaces_the_default_groups(self, capfd: pytest.CaptureFixture[str], tmp_path: Path, recipe: str) -> None:
        config_file = tmp_path / "config.yaml"

        config_file.write_text("optimizer:\n  config:\n    groups:\n      - params: '.*\\.bias$'\n        weight_decay: 0.0\n")

        groups = dump_config(capfd, recipe, "--config", str(config_file))["optimizer"]["config"]["groups"]

        assert [group["params"] for group in groups] == [".*\\.bias$"]

        # An empty list decays every parameter.
        groups = dump_config(capfd, recipe, "--config", str(config_file), "--set", "optimizer.config.groups=[]")["optimizer"]["config"]["groups"]

        assert groups == []
