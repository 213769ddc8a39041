"""Putting LoRA adapters on a Qwen3.5 model, selected by Hugging Face names."""

from __future__ import annotations

import torch
from torch.nn import Module, Parameter

from fairseq2.nn import Projection
from fairseq2.utils.validation import StandardObjectValidator

from qwen35_fs2.hf.export.tensors import to_hg_state_dict
from qwen35_fs2.lora.config import LoraConfig
from qwen35_fs2.models.qwen35.config import Qwen35Config
from qwen35_fs2.models.qwen35.interop import has_mtp_tensors
from qwen35_fs2.nn.lora import LoraAdapter, add_lora_adapter


def apply_lora(model: Module, config: LoraConfig, model_config: Qwen35Config) -> dict[str, LoraAdapter]:
    """Freezes every parameter of ``model`` and puts a LoRA adapter on each
    projection that ``config.target_modules`` names.

    A projection is named by its Hugging Face module name (the key the
    checkpoint converter gives its weight), so a name selects in our model
    exactly what it selects in PEFT on the transformers model, also where
    our names differ (``o_proj`` is our ``output_proj``). The base
    parameters keep their dtype; the adapters are created in the dtype of
    their projection.

    The rows of our Gated DeltaNet ``in_proj_qkv`` are grouped by key head
    (docs/architecture.md), so its adapter's ``B`` rows are too: the update
    ``B A`` then has the weight's row order, and the export permutes ``B``'s
    rows as the converter permutes the weight's.

    The multi-token-prediction head (``mtp.*``) gets no adapters and stays
    frozen: transformers does not build it, so PEFT could not load adapters
    on it, and an export would hold adapters that no server applies.

    Call it after loading the base weights: the adapters are new parameters
    that a base checkpoint does not have.

    :returns: The adapters, by the names of their projections in ``model``.

    :raises ValidationError: if ``config`` is invalid: an unknown target
        name, ``r`` not greater than 0.
    :raises ValueError: if ``model`` has adapters already, or a target name
        selects no projection of ``model``.
    """
    StandardObjectValidator().validate(config)

    if any(isinstance(m, LoraAdapter) for m in model.modules()):
        raise ValueError("`model` must not have LoRA adapters yet, but has some instead.")

    targets = set(config.target_modules)

    selected = {}

    for name, module in model.named_modules():
        if not isinstance(module, Projection):
            continue

        hg_name = hg_module_name(name, module, model_config)

        if hg_name is None or has_mtp_tensors([hg_name]):
            continue

        if hg_name.rsplit(".", 1)[-1] in targets:
            selected[name] = (module, hg_name)

    unmatched = targets - {hg_name.rsplit(".", 1)[-1] for _, hg_name in selected.values()}

    if unmatched:
        raise ValueError(
            f"`target_modules` must name projections of the model, but {', '.join(f'`{n}`' for n in sorted(unmatched))} selects none."
        )

    for param in model.parameters():
        param.requires_grad_(False)

    adapters = {}

    for name, (module, _) in selected.items():
        adapters[name] = add_lora_adapter(
            module, rank=config.r, alpha=config.alpha, dropout_p=config.dropout_p, rslora=config.rslora
        )

    return adapters


def hg_module_name(name: str, proj: Projection, model_config: Qwen35Config) -> str | None:
    """Returns the Hugging Face module name of the projection ``name`` of our
    model, or ``None`` if the Hugging Face model has none (the output
    projection of a tied model).

    The name is the key that the checkpoint converter gives the weight, less
    ``.weight``; a meta tensor of the weight's shape stands in for it, so
    the converter's row permutation copies nothing.
    """
    weight = torch.empty((proj.output_dim, proj.input_dim), device="meta")

    converted = to_hg_state_dict({f"{name}.weight": weight}, model_config)

    if not converted:
        return None

    (hg_key,) = converted

    return hg_key.removesuffix(".weight")


def lora_parameters(model: Module) -> list[Parameter]:
    """Returns the parameters of the LoRA adapters of ``model``: the only
    ones that need gradients and optimizer state."""
    return [param for module in model.modules() if isinstance(module, LoraAdapter) for param in module.parameters()]
