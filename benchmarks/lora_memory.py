"""Measures what LoRA saves against full fine-tuning in a training step of
the dense reference configuration of ``train_step.py``, for qwen35-fs2 and
for PEFT on the transformers reference, in the same run, with the matmul
floor of both.

A training step is forward, backward, ``AdamW.step()`` and ``zero_grad``,
with AdamW given every parameter of the model, as fairseq2's recipes give it
(PyTorch's AdamW keeps no state for parameters without a gradient). LoRA puts
adapters of rank ``--rank`` on every projection of the trunk (the twelve
Hugging Face names of ``qwen35_fs2.lora.LORA_TARGET_MODULES``); the
embedding and the LM head stay frozen. Variants, each in a fresh subprocess:

- ``ours_full``, ``ours_lora``: our model built by fairseq2 with the loss the
  recipes train with, the adapters put on by ``apply_lora``, as the recipes'
  ``lora`` section does;
- ``reference_full``, ``reference_lora``: transformers' ``Qwen3_5ForCausalLM``
  from the isolated overlay (``QWEN35_HF_REFERENCE_DIR``), the adapters by
  PEFT's ``get_peft_model`` with the same target names, rank and alpha;
- ``floor_full``, ``floor_lora``: the step's GEMMs alone on random tensors.
  Full fine-tuning: every projection and the LM head forward, input gradient
  and weight gradient. LoRA: the same without the weight gradients of the
  frozen matrices and without the input gradients of the projections that
  read the frozen embedding, plus the adapters' GEMMs (each ``A`` and ``B``
  forward and both gradients).

Reported per variant: the trainable parameters; the bytes of the gradients
after the backward pass and of the optimizer's state after the steps (summed
over the tensors in ``optimizer.state``); the activations autograd keeps for
the backward pass (``saved_tensors_hooks`` in one more forward pass, each
storage once, parameters excluded); the step time (the fastest step, the
least disturbed by other processes, in wall time and in CPU time of all
threads; and the median); and the peak memory of the steps, as the process's
peak resident set (``ru_maxrss``) minus its value before the first step.
The resident set is what the kernel counts, so it includes everything a step
allocates (autograd's saved tensors, gradients, the optimizer state created
by the first step, the allocator's slack) and ``ru_maxrss`` is the kernel's
own high-water mark, so no peak falls between two samples; it only grows, so
each variant runs in its own process. torch's memory profiler on CPU would
see only the tensors of the c10 allocator, one operator at a time.

Prints one JSON line with the CPU model (``lscpu``). Example::

    .venv/bin/python benchmarks/lora_memory.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeAlias

# The configuration and the measurement code are the training-step
# benchmarks'.
from train_step import (
    BenchConfig,
    cpu_model,
    gemm_shapes,
    max_rss_mib,
    ours_config,
    reference_config,
    spawn_worker,
    time_steps_with_cpu,
)

# `qwen35_fs2.lora.LORA_TARGET_MODULES`, spelled out: the reference worker
# runs transformers 5.x and must not import our package.
TARGET_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj",
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
    "gate_proj", "up_proj", "down_proj",
)  # fmt: skip

# The optimizer of the recipes' configs.
LR = 1e-4

BETAS = (0.9, 0.95)

WorkerResult: TypeAlias = dict[str, Any]


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _train(
    model: Any, loss_fn: Callable[[], Any], args: argparse.Namespace
) -> WorkerResult:
    """Times training steps of ``model`` with AdamW over all its parameters;
    returns the times, the memory and the sizes of the trainable state."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=0.0)

    params = list(model.parameters())

    grad_bytes = 0

    def step() -> None:
        nonlocal grad_bytes

        torch.autograd.backward(loss_fn())

        grad_bytes = _tensor_bytes(p.grad for p in params if p.grad is not None)

        optimizer.step()

        optimizer.zero_grad(set_to_none=True)

    baseline_rss = max_rss_mib()

    times, cpu_times = time_steps_with_cpu(step, args.num_warmup, args.num_steps)

    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]

    # One more forward pass, after the timing: the activations autograd
    # keeps for the backward pass, each storage once, the parameters not.
    param_storages = {p.untyped_storage().data_ptr() for p in params}

    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()

        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()

        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss_fn()

    return {
        "times": times,
        "cpu_times": cpu_times,
        "baseline_rss_mib": baseline_rss,
        "peak_rss_mib": max_rss_mib(),
        "params": sum(p.numel() for p in params),
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
        "grad_bytes": grad_bytes,
        "optimizer_state_bytes": _tensor_bytes(state),
        "params_with_optimizer_state": sum(1 for s in optimizer.state.values() if s),
        "saved_for_backward_bytes": sum(saved.values()),
    }


def _run_ours(cfg: BenchConfig, args: argparse.Namespace, lora: bool) -> WorkerResult:
    import torch

    from fairseq2.nn import BatchLayout

    from qwen35_fs2.lora import LoraConfig, apply_lora
    from qwen35_fs2.models.qwen35 import create_qwen35_model
    from qwen35_fs2.recipes.loss import install_chunked_lm_loss

    config = ours_config(cfg)

    torch.manual_seed(0)

    model = create_qwen35_model(config)

    # Before the loss, in the order of the recipes' `setup_model`.
    if lora:
        apply_lora(model, LoraConfig(target_modules=list(TARGET_MODULES), r=args.rank, alpha=args.alpha), config)

    model = install_chunked_lm_loss(model).train()

    seqs = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1))

    inputs, targets = seqs[:, :-1], seqs[:, 1:]

    layout = BatchLayout.of(inputs)

    return _train(model, lambda: model(inputs, layout, targets, reduction="mean"), args)


def _run_reference(cfg: BenchConfig, args: argparse.Namespace, lora: bool) -> WorkerResult:
    config = reference_config(cfg)

    import torch
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)

    model = Qwen3_5ForCausalLM(config)

    if lora:
        from peft import LoraConfig, get_peft_model

        peft_config = LoraConfig(target_modules=list(TARGET_MODULES), r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0)

        model = get_peft_model(model, peft_config)

    model.train()

    input_ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len))

    return _train(model, lambda: model(input_ids=input_ids, labels=input_ids, use_cache=False).loss, args)


def _run_floor(cfg: BenchConfig, args: argparse.Namespace, lora: bool) -> WorkerResult:
    import torch

    num_tokens = cfg.batch_size * cfg.seq_len

    shapes = gemm_shapes(cfg)

    # The mixer projections of layer 0 that read its normed input, a function
    # of the frozen embedding alone (layer 0 is a Gated DeltaNet).
    num_first_mixer_inputs = 4

    torch.manual_seed(0)

    # (x, w, dy, input gradient?, weight gradient?) of each GEMM.
    operands = []

    for idx, (input_dim, output_dim) in enumerate(shapes):
        x = torch.randn(num_tokens, input_dim)
        w = torch.randn(output_dim, input_dim)
        dy = torch.randn(num_tokens, output_dim)

        needs_input_grad = not lora or idx >= num_first_mixer_inputs

        operands.append((x, w, dy, needs_input_grad, not lora))

        # The adapters of the trunk's projections (all but the LM head).
        if lora and idx < len(shapes) - 1:
            a = torch.randn(args.rank, input_dim)
            b = torch.randn(output_dim, args.rank)

            operands.append((x, a, torch.randn(num_tokens, args.rank), needs_input_grad, True))
            operands.append((torch.randn(num_tokens, args.rank), b, dy, True, True))

    flops = sum(2 * num_tokens * w.numel() * (1 + dx + dw) for _, w, _, dx, dw in operands)

    def step() -> None:
        for x, w, dy, dx, dw in operands:
            x @ w.t()  # forward

            if dx:
                dy @ w

            if dw:
                dy.t() @ x

    times, cpu_times = time_steps_with_cpu(step, args.num_warmup, args.num_steps)

    return {"times": times, "cpu_times": cpu_times, "flops": flops}


_RUNNERS = {"ours": _run_ours, "reference": _run_reference, "floor": _run_floor}

_WORKERS = [f"{impl}_{mode}" for impl in _RUNNERS for mode in ("full", "lora")]


def _entry(result: WorkerResult, num_tokens: int) -> dict[str, Any]:
    # The fastest step, the least disturbed on a shared machine (as
    # `train_step_moe.py` counts).
    step_s = min(result["times"])

    entry: dict[str, Any] = {
        "step_s": round(step_s, 4),
        "median_step_s": round(statistics.median(result["times"]), 4),
        "cpu_step_s": round(min(result["cpu_times"]), 4),
        "tokens_per_s": round(num_tokens / step_s, 1),
    }

    if "flops" in result:
        entry["gflop"] = round(result["flops"] / 1e9, 1)

        return entry

    entry.update(
        params=result["params"],
        trainable_params=result["trainable_params"],
        params_with_optimizer_state=result["params_with_optimizer_state"],
        grad_mib=round(result["grad_bytes"] / 2**20, 2),
        optimizer_state_mib=round(result["optimizer_state_bytes"] / 2**20, 2),
        saved_for_backward_mib=round(result["saved_for_backward_bytes"] / 2**20, 1),
        peak_rss_mib=round(result["peak_rss_mib"], 1),
        step_peak_above_init_mib=round(result["peak_rss_mib"] - result["baseline_rss_mib"], 1),
    )

    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-warmup", type=int, default=1)
    parser.add_argument("--num-steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank r")
    parser.add_argument("--alpha", type=float, default=32.0, help="the adapters' alpha")
    parser.add_argument("--worker", choices=_WORKERS, help=argparse.SUPPRESS)

    args = parser.parse_args()

    cfg = BenchConfig(seq_len=args.seq_len)

    if args.worker is not None:
        import torch

        torch.set_num_threads(args.threads)

        impl, mode = args.worker.split("_")

        result = _RUNNERS[impl](cfg, args, mode == "lora")

        print(json.dumps(result))

        return

    num_tokens = cfg.batch_size * cfg.seq_len

    report: dict[str, Any] = {
        "config": asdict(cfg),
        "lora_config": {"target_modules": list(TARGET_MODULES), "r": args.rank, "alpha": args.alpha},
        "threads": args.threads,
        "cpu": cpu_model(),
    }

    for worker in _WORKERS:
        # `spawn_worker` gives the reference workers the overlay's path.
        impl, mode = worker.split("_")

        result = spawn_worker(__file__, worker, args)

        report.setdefault(mode, {})[impl] = _entry(result, num_tokens)

    for impl in ("ours", "reference"):
        full, lora = report["full"][impl], report["lora"][impl]

        report.setdefault("lora_over_full", {})[impl] = {
            "trainable_params": round(lora["trainable_params"] / full["trainable_params"], 5),
            "optimizer_state": round(lora["optimizer_state_mib"] / full["optimizer_state_mib"], 5),
            "saved_for_backward": round(lora["saved_for_backward_mib"] / full["saved_for_backward_mib"], 3),
            "step_peak_above_init": round(lora["step_peak_above_init_mib"] / full["step_peak_above_init_mib"], 3),
            "step_s": round(lora["step_s"] / full["step_s"], 3),
            "cpu_step_s": round(lora["cpu_step_s"] / full["cpu_step_s"], 3),
        }

    for mode in ("full", "lora"):
        ours, reference, floor = (report[mode][impl] for impl in _RUNNERS)

        report[mode]["speedup_vs_reference"] = round(ours["tokens_per_s"] / reference["tokens_per_s"], 3)
        report[mode]["ours_fraction_of_floor"] = round(ours["tokens_per_s"] / floor["tokens_per_s"], 3)
        report[mode]["reference_fraction_of_floor"] = round(reference["tokens_per_s"] / floor["tokens_per_s"], 3)

    print(json.dumps(report))


if __name__ == "__main__":
    main()
