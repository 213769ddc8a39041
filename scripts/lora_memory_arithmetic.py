"""The numbers of the memory arithmetic of docs/lora.md, computed from our
architecture configs: parameters, LoRA adapter parameters, bytes per GPU of
LoRA and full fine-tuning, and the activations a training step keeps per
token.

- Parameters and adapters are counted on a model built on the meta device
  (no memory) with the released checkpoints' MTP head (``mtp_num_layers=1``,
  which loading adopts from their config.json), the adapters put on by
  ``apply_lora`` as the recipes' ``lora`` section does.
- The activations are the tensors autograd saves for the backward pass
  (``torch.autograd.graph.saved_tensors_hooks``) in the forward pass of a
  bf16 model of the real widths with 4 layers (3 Gated DeltaNet, 1 gated
  attention) on one sequence of ``--tokens`` tokens, run under
  ``FakeTensorMode`` (shapes and dtypes only: no memory, no compute).
  Tensors are counted once per storage, parameters not at all (under FSDP2
  the gathered weights are the FSDP buffers, not activations). Routing is
  data-dependent, which ``FakeTensorMode`` cannot run: for MoE models the
  count is that of the dense model with the same mixers and the shared
  expert as its MLP, plus an estimate for the routed experts, the bf16
  tensors of full fine-tuning: for each of the ``top_k`` experts of a token
  its copy of the token, the gate and up outputs and their GLU product
  (``2 * top_k * (d + 3 * moe_inner_dim)`` bytes).

Prints one JSON line. Example::

    PYTHONPATH=src .venv/bin/python scripts/lora_memory_arithmetic.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter
from typing import Any

import torch
from torch.nn import Module
from torch._subclasses.fake_tensor import FakeTensorMode

from fairseq2.nn import BatchLayout, Projection

from qwen35_fs2.lora import LoraConfig, apply_lora, hg_module_name
from qwen35_fs2.models.qwen35 import Qwen35Config, create_qwen35_model, get_qwen35_model_hub
from qwen35_fs2.models.qwen35_moe import Qwen35MoeConfig, create_qwen35_moe_model, get_qwen35_moe_model_hub
from qwen35_fs2.recipes.loss import install_chunked_lm_loss

ARCHS = ("qwen35_9b", "qwen35_27b", "qwen35_moe_35b_a3b")

NUM_GPUS = 8

GB = 1e9


def _arch_config(arch: str) -> Qwen35Config:
    hub = get_qwen35_moe_model_hub() if "moe" in arch else get_qwen35_model_hub()

    return dataclasses.replace(hub.get_arch_config(arch), mtp_num_layers=1)


def _create_model(config: Qwen35Config) -> Module:
    if isinstance(config, Qwen35MoeConfig):
        return create_qwen35_moe_model(config)

    return create_qwen35_model(config)


def _count(config: Qwen35Config, rank: int) -> dict[str, Any]:
    with torch.device("meta"):
        model = _create_model(config)

    params = dict(model.named_parameters())

    num_params = sum(p.numel() for p in params.values())

    adapters = apply_lora(model, LoraConfig(r=rank), config)

    by_target: Counter[str] = Counter()

    for name, adapter in adapters.items():
        proj = model.get_submodule(name)

        assert isinstance(proj, Projection)

        hg_name = hg_module_name(name, proj, config)

        assert hg_name is not None

        by_target[hg_name.rsplit(".", 1)[-1]] += sum(p.numel() for p in adapter.parameters())

    num_adapter_params = sum(by_target.values())

    return {
        "params": num_params,
        "mtp_params": sum(p.numel() for name, p in params.items() if name.startswith("mtp")),
        "num_adapters": len(adapters),
        "adapter_params": num_adapter_params,
        "adapter_params_by_target": dict(by_target),
        # `model.dtype` fp32, as the recipes keep it: 4 bytes; bf16: 2.
        "frozen_base_fp32_per_gpu_gb": round(4 * num_params / NUM_GPUS / GB, 2),
        "frozen_base_bf16_per_gpu_gb": round(2 * num_params / NUM_GPUS / GB, 2),
        # fp32 weights, gradients, AdamW's two moments.
        "adapter_state_gb": round(16 * num_adapter_params / GB, 3),
        "adapter_state_per_gpu_gb": round(16 * num_adapter_params / NUM_GPUS / GB, 3),
        "full_ft_state_per_gpu_gb": round(16 * num_params / NUM_GPUS / GB, 1),
    }


def _saved_bytes_per_token(config: Qwen35Config, num_tokens: int, lora: bool, rank: int) -> dict[str, float]:
    """Returns the bytes autograd saves per token in each of the 4 layers of
    a bf16 model of ``config``'s widths and in the rest of the model (the
    embedding, the final norm, the loss); the routed experts estimated."""
    routed = 0

    if isinstance(config, Qwen35MoeConfig):
        experts = config.experts

        routed = 2 * experts.top_k * (config.model_dim + 3 * experts.inner_dim)

        dense = {field.name: getattr(config, field.name) for field in dataclasses.fields(Qwen35Config)}

        config = Qwen35Config(**(dense | {"ffn_inner_dim": experts.shared_expert_inner_dim}))

    config = dataclasses.replace(config, num_layers=4, mtp_num_layers=0, gdn_backend="torch")

    with FakeTensorMode():
        model = _create_model(config).to(torch.bfloat16)

        if lora:
            apply_lora(model, LoraConfig(r=rank), config)

        model = install_chunked_lm_loss(model).train()

        seqs = torch.zeros((1, num_tokens + 1), dtype=torch.int64)

        inputs, targets = seqs[:, :-1], seqs[:, 1:]

        param_storages = {p.untyped_storage()._cdata for p in model.parameters()}

        saved: dict[str, dict[int, int]] = {}

        where = ["other"]

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()

            if storage._cdata not in param_storages:
                saved.setdefault(where[0], {})[storage._cdata] = storage.nbytes()

            return tensor

        for idx, layer in enumerate(model.decoder.layers):  # type: ignore[union-attr, arg-type]
            layer.register_forward_pre_hook(lambda *_, idx=idx: where.__setitem__(0, f"layer_{idx}"))
            layer.register_forward_hook(lambda *_: where.__setitem__(0, "other"))

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(inputs, BatchLayout.of(inputs), targets, reduction="sum")

    return {where: round(sum(storages.values()) / num_tokens) + (routed if where != "other" else 0) for where, storages in saved.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank r")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the sequence whose activations are counted")

    args = parser.parse_args()

    report: dict[str, Any] = {"r": args.rank, "num_gpus": NUM_GPUS, "tokens": args.tokens}

    for arch in ARCHS:
        config = _arch_config(arch)

        entry = _count(config, args.rank)

        for mode in ("full", "lora"):
            saved = _saved_bytes_per_token(config, args.tokens, mode == "lora", args.rank)

            num_linear = config.num_layers - config.num_layers // config.full_attention_interval

            num_full = config.num_layers - num_linear

            # Layer 0 (Gated DeltaNet) keeps less under LoRA: its input does
            # not need a gradient. Layers 1, 2 are the other Gated DeltaNets,
            # layer 3 the attention layers.
            per_token = saved["layer_0"] + (num_linear - 1) * saved["layer_1"] + num_full * saved["layer_3"] + saved["other"]

            entry[f"saved_{mode}"] = {
                "gated_deltanet_layer_bytes_per_token": saved["layer_1"],
                "attention_layer_bytes_per_token": saved["layer_3"],
                "rest_bytes_per_token": saved["other"],
                "model_bytes_per_token": per_token,
                "model_gb_at_tokens": round(per_token * args.tokens / GB, 1),
                # Layerwise checkpointing: the bf16 input of every layer, plus
                # one layer recomputed at a time.
                "layerwise_ac_gb_at_tokens": round(
                    (2 * config.model_dim * config.num_layers + max(saved["layer_1"], saved["layer_3"]) + saved["other"]) * args.tokens / GB, 1
                ),
            }

        report[arch] = entry

    print(json.dumps(report))


if __name__ == "__main__":
    main()
