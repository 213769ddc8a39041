"""Loads tiny Qwen3.5 models straight into FSDP2 shards over 2 ranks and
compares them with the unsharded model; run by ``test_fsdp2.py`` under
``torchrun --nproc_per_node=2``.

For each case, rank 0 saves a random reference model as a 2-file Hugging
Face checkpoint; every rank creates the model on the meta device, shards it
with the family's FSDP applier, allocates its shards and reads them from the
checkpoint. Then:

- every decoder layer is an FSDP unit holding about half of its parameters
  on each rank (experts split by expert), the last one not resharded after
  its forward pass, and the embedding and the final norm are in the root;
- the full state dict gathered from the shards is the reference's, bit for
  bit;
- each rank runs half of a batch: the losses summed over the ranks and the
  gathered gradients are those of the reference on the whole batch.

The MoE model has LoRA adapters on every projection and on both stacked
expert weights, put as the recipes put them: on the meta model before it is
sharded, initialized after its shards are read. From the same seed they are
the reference's, bit for bit (``A`` random, ``B`` zero). Moved away from
zero, the same in both models, they change the loss and get gradients; the
base is trained too, so that its gradients through the adapted experts are
checked as well.

Writes ``{case: {"layer_fractions": [...], "max_grad_diff": ..., "loss_diff":
..., "expert_adapter_grads": ...}}`` to ``--output-dir/result.json`` (rank 0).

A last case wraps a model with fairseq2's own ``to_fsdp2`` under static bf16
mixed precision, as the recipes do, and records the dtypes that the Gated
DeltaNet decay parameters, their gradients and the projections have in the
forward and backward passes, and the dtype of the MoE routers' weights in
their forward pass for both router precisions (``"mixed_precision"``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch
from sharding_testing import CPU, create_reference_model, save_hf_checkpoint
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn import Module

from fairseq2.gang import Gangs, ProcessGroupGang, ReduceOperation, create_fsdp_gangs, create_parallel_gangs, set_gangs
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn import BatchLayout
from fairseq2.nn.fsdp import FSDPWrapper, to_fsdp2

from qwen35_fs2.lora import LORA_TARGET_PARAMETERS, LoraConfig, apply_lora
from qwen35_fs2.models.qwen35_moe import create_qwen35_moe_model
from qwen35_fs2.nn import collect_moe_statistics
from qwen35_fs2.nn.moe.router import TopKRouter
from qwen35_fs2.nn.lora import ExpertLoraAdapter, reset_lora_adapters
from qwen35_fs2.models.qwen35.config import Qwen35Config, tiny_qwen35_config
from qwen35_fs2.parallel.fsdp import apply_fsdp_to_qwen35
from qwen35_fs2.nn.gated_deltanet import GatedDeltaNet, GatedDeltaNetDecay
from qwen35_fs2.models.qwen35_moe.config import tiny_qwen35_moe_config
from qwen35_fs2.hf.sharded_loading import (
    allocate_shards,
    create_sharded_qwen35_model,
    load_hf_checkpoint_shards,
)

TOLERANCE = 1e-5

# Rank 4 and a scaling of 2 on every projection and both stacked expert
# weights.
_LORA = LoraConfig(r=4, alpha=8.0, target_parameters=list(LORA_TARGET_PARAMETERS))

_LORA_SEED = 5


def _cases() -> dict[str, tuple[Qwen35Config, str, LoraConfig | None]]:
    return {
        "dense_layer": (tiny_qwen35_config(), "layer", None),
        "moe_layer": (tiny_qwen35_moe_config(), "layer", _LORA),
        "dense_stack": (tiny_qwen35_config(), "stack", None),
        "dense_model": (tiny_qwen35_config(), "model", None),
    }


def _loss(model: Module, seqs: Tensor, seq_lens: list[int]) -> Tensor:
    inputs, targets = seqs[:, :-1], seqs[:, 1:]

    target_lens = [n - 1 for n in seq_lens]

    target_mask = torch.arange(inputs.size(1)) < torch.tensor(target_lens).unsqueeze(1)

    loss: Tensor = model(inputs, BatchLayout(inputs.shape, target_lens), targets, target_mask=target_mask, reduction="sum")

    statistics = collect_moe_statistics(model)

    if statistics is not None:
        loss = loss + 0.5 * statistics.load_balancing_loss

    return loss


def _shares(vocab_size: int) -> list[tuple[Tensor, list[int]]]:
    generator = torch.Generator().manual_seed(3)

    shares = []

    for seq_lens in ([11, 7], [9, 11]):
        shares.append((torch.randint(1, vocab_size, (2, 11), generator=generator), seq_lens))

    return shares


def _layer_fractions(model: TransformerLM) -> list[float]:
    """The fraction of each decoder layer's parameters that this rank holds."""
    fractions = []

    for layer in model.decoder.layers:
        params = list(layer.parameters())

        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)

        fractions.append(local / sum(p.numel() for p in params))

    return fractions


def _check_units(model: TransformerLM, granularity: str) -> None:
    assert isinstance(model, FSDPModule)

    if granularity == "layer":
        layers = list(model.decoder.layers)

        assert all(isinstance(layer, FSDPModule) for layer in layers)

        # Resharding after the forward pass is recorded as the mesh to reshard
        # to; the last layer has none.
        reshards = [layer._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None for layer in layers]

        assert reshards == [True] * (len(layers) - 1) + [False], reshards

    if granularity == "stack":
        assert isinstance(model.decoder, FSDPModule)

    root_params = model._get_fsdp_state()._fsdp_param_group.fsdp_params

    root_modules = {fsdp_param._module_info.module for fsdp_param in root_params}

    assert model.decoder_frontend.embed in root_modules

    if granularity != "stack":
        assert model.decoder.layer_norm in root_modules


def _create_sharded_lora_model(config: Qwen35Config, lora: LoraConfig, granularity: str, gangs: Gangs, path: Path) -> TransformerLM:
    """As the LoRA recipes build it: adapters on the meta model, sharded and
    allocated with it, the base read into its shards, then the adapters
    initialized."""
    with torch.device("meta"), set_gangs(gangs, meta=True):
        model = create_qwen35_moe_model(config)

    apply_lora(model, lora, config)

    allocate_shards(model, gangs, fsdp_granularity=granularity)

    load_hf_checkpoint_shards(model, path, config, gangs)

    torch.manual_seed(_LORA_SEED)

    reset_lora_adapters(model)

    return model


def _move_adapters(reference: Module, model: Module) -> None:
    """Adds the same noise to the adapters of both models, so that they
    change the loss (``B`` is no longer zero) and ``A`` gets gradients."""
    generator = torch.Generator().manual_seed(4)

    params = dict(model.named_parameters())

    with torch.no_grad():
        for name, expected in reference.named_parameters():
            if not expected.requires_grad:
                continue

            expected.add_(torch.randn(expected.shape, generator=generator) * 0.05)

            param = params[name]

            assert isinstance(param, DTensor), name

            param.to_local().copy_(distribute_tensor(expected.detach(), param.device_mesh, param.placements).to_local())


def _check_case(name: str, config: Qwen35Config, granularity: str, lora: LoraConfig | None, gangs: Gangs, output_dir: Path) -> dict[str, object]:
    rank = gangs.root.rank

    reference = create_reference_model(config).train()

    path = output_dir / name

    if rank == 0:
        save_hf_checkpoint(reference, config, path)

    gangs.root.barrier()

    if lora is None:
        model = create_sharded_qwen35_model(config, gangs, fsdp_granularity=granularity)

        load_hf_checkpoint_shards(model, path, config, gangs)
    else:
        model = _create_sharded_lora_model(config, lora, granularity, gangs, path)

        # New adapters of the unsharded model from the same seed.
        apply_lora(reference, lora, config)

        torch.manual_seed(_LORA_SEED)

        reset_lora_adapters(reference)

    model.train()

    _check_units(model, granularity)

    # The full state dict, gathered from the shards.
    state_dict = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}

    expected_state_dict = reference.state_dict()

    assert state_dict.keys() == expected_state_dict.keys()

    for key, value in expected_state_dict.items():
        assert torch.equal(state_dict[key], value), key

    if lora is not None:
        _move_adapters(reference, model)

        # The base, which `apply_lora` froze, trains too.
        for param in [*reference.parameters(), *model.parameters()]:
            param.requires_grad_(True)

    # Gradients: each rank runs its share; FSDP averages, the reference sums.
    shares = _shares(config.vocab_size)

    expected_loss = 0.0

    for seqs, seq_lens in shares:
        loss = _loss(reference, seqs, seq_lens)

        torch.autograd.backward(loss)

        expected_loss += loss.item()

    seqs, seq_lens = shares[rank]

    loss = _loss(model, seqs, seq_lens)

    torch.autograd.backward(loss * gangs.dp.size)

    total_loss = loss.detach().clone()

    gangs.dp.all_reduce(total_loss, ReduceOperation.SUM)

    loss_diff = abs(total_loss.item() - expected_loss) / max(1.0, abs(expected_loss))

    assert loss_diff <= TOLERANCE, f"loss: {total_loss.item()} != {expected_loss}"

    max_grad_diff = 0.0

    expected_params = dict(reference.named_parameters())

    expert_adapters = {n for n, m in model.named_modules() if isinstance(m, ExpertLoraAdapter)}

    expert_adapter_grads = 0

    for param_name, param in model.named_parameters():
        expected = expected_params[param_name]

        assert param.grad is not None and expected.grad is not None, param_name

        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad

        scale = max(1.0, expected.grad.abs().max().item())

        diff = (grad - expected.grad).abs().max().item() / scale

        assert diff <= TOLERANCE, f"{param_name}: {diff}"

        max_grad_diff = max(max_grad_diff, diff)

        if param_name.rsplit(".", 1)[0] in expert_adapters:
            # The gradient of ``A`` is zero unless ``B`` is not.
            assert expected.grad.abs().max() > 0, param_name

            expert_adapter_grads += 1

    return {
        "layer_fractions": _layer_fractions(model),
        "max_grad_diff": max_grad_diff,
        "loss_diff": loss_diff,
        "expert_adapter_grads": expert_adapter_grads,
    }


def _check_mixed_precision(gangs: Gangs) -> dict[str, object]:
    """Static bf16 through fairseq2's FSDP2 wrapper, with the family applier
    at ``layer`` granularity."""
    config = tiny_qwen35_config()

    model = create_reference_model(config).train()

    reference = create_reference_model(config).train()

    def apply(module: Module, wrapper: FSDPWrapper) -> Module:
        return apply_fsdp_to_qwen35(module, "layer", wrapper)  # type: ignore[arg-type]

    model = to_fsdp2(model, gangs, apply, mixed_precision_dtype=torch.bfloat16)

    seen: dict[str, set[str]] = {"decay_params": set(), "decay_grads": set(), "decay_outputs": set(), "proj_weights": set()}

    def record_decay(module: Module, args: tuple[object, ...]) -> None:
        for param in (module.A_log, module.dt_bias):
            seen["decay_params"].add(str(param.dtype))

            param.register_hook(lambda grad: seen["decay_grads"].add(str(grad.dtype)))

    def record_decay_output(module: Module, args: tuple[object, ...], output: Tensor) -> None:
        seen["decay_outputs"].add(str(output.dtype))

    def record_proj(module: Module, args: tuple[object, ...]) -> None:
        seen["proj_weights"].add(str(module.weight.dtype))

    for module in model.modules():
        if isinstance(module, GatedDeltaNetDecay):
            module.register_forward_pre_hook(record_decay)
            module.register_forward_hook(record_decay_output)

        if isinstance(module, GatedDeltaNet):
            for proj in (module.in_proj_qkv, module.in_proj_a, module.output_proj):
                proj.register_forward_pre_hook(record_proj)

    seqs, seq_lens = _shares(config.vocab_size)[gangs.root.rank]

    torch.autograd.backward(_loss(model, seqs, seq_lens) * gangs.dp.size)

    for seqs, seq_lens in _shares(config.vocab_size):
        torch.autograd.backward(_loss(reference, seqs, seq_lens))

    # The sharded gradients of the decay parameters, gathered, against the
    # fp32 reference (the rest of the model ran in bf16).
    expected_params = dict(reference.named_parameters())

    decay_grad_errors = {}

    for name, param in model.named_parameters():
        if ".decay." in name:
            assert param.grad is not None, name

            grad = param.grad.full_tensor()

            expected = expected_params[name].grad

            assert expected is not None

            decay_grad_errors[name] = ((grad - expected).norm() / expected.norm()).item()

            seen.setdefault("sharded_decay", set()).add(f"{param.dtype}/{grad.dtype}")

    return {
        **{k: sorted(v) for k, v in seen.items()},
        "decay_grad_errors": decay_grad_errors,
        "router_weights": {precision: _router_weight_dtypes(precision, gangs) for precision in ("activation", "fp32")},
    }


def _router_weight_dtypes(precision: str, gangs: Gangs) -> list[str]:
    """The dtypes of the weights the MoE routers of ``precision`` compute
    with, in a forward and backward pass under static bf16 mixed precision
    (as in :func:`_check_mixed_precision`)."""
    config = tiny_qwen35_moe_config()

    config.experts = replace(config.experts, router_precision=precision)

    def apply(module: Module, wrapper: FSDPWrapper) -> Module:
        return apply_fsdp_to_qwen35(module, "layer", wrapper)  # type: ignore[arg-type]

    model = to_fsdp2(create_reference_model(config).train(), gangs, apply, mixed_precision_dtype=torch.bfloat16)

    seen: set[str] = set()

    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.register_forward_pre_hook(lambda module, args: seen.add(str(module.weight.dtype)))

    seqs, seq_lens = _shares(config.vocab_size)[gangs.root.rank]

    _loss(model, seqs, seq_lens).backward()

    return sorted(seen)


def main() -> None:
    parser = argparse.ArgumentParser()

    parser.add_argument("--output-dir", type=Path, required=True)

    args = parser.parse_args()

    torch.set_num_threads(1)

    root_gang = ProcessGroupGang.create_default_process_group(CPU)

    gangs = create_fsdp_gangs(create_parallel_gangs(root_gang))

    results = {name: _check_case(name, config, granularity, lora, gangs, args.output_dir) for name, (config, granularity, lora) in _cases().items()}

    results["mixed_precision"] = _check_mixed_precision(gangs)

    if root_gang.rank == 0:
        (args.output_dir / "result.json").write_text(json.dumps(results))

    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
