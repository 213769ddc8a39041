"""Measures the gated delta rule, forward + backward, against transformers'
PyTorch reference (``torch_chunk_gated_delta_rule``).

Each variant runs in a fresh subprocess, the reference with the transformers
5.x overlay (``QWEN35_HF_REFERENCE_DIR``) on its path and fla hidden:

- ``ours``: :func:`qwen35_fs2.ops.chunk_gated_delta_rule`;
- ``reference``: ``transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule``,
  with ``use_qk_l2norm_in_kernel=True``, as Qwen3.5 calls it.

Both get the same inputs: ``g = -A * softplus(a + 1)`` with ``A ~ U(0.01,
max_decay)`` per value head (the released models draw ``A`` up to 16).

Reported per variant, over ``--rounds`` alternating runs: the median and the
best wall time of a step, its best CPU time (all threads; steadier than wall
time on a loaded machine), the peak RSS a step adds over the inputs
(``ru_maxrss``, so allocator caching included), and the bytes autograd keeps
for the backward (deterministic). Prints one JSON line. Example::

    .venv/bin/python benchmarks/delta_rule.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

# The process handling is shared with the training-step benchmarks.
from train_step import max_rss_mib, spawn_worker


def _kernel(variant: str) -> Any:
    if variant == "ours":
        from qwen35_fs2.ops import chunk_gated_delta_rule

        return lambda q, k, v, g, beta: chunk_gated_delta_rule(q, k, v, g, beta)[0]

    # transformers calls fla whenever importable; it fails on CPU.
    for name in ("fla", "causal_conv1d"):
        sys.modules[name] = None  # type: ignore[assignment]

    from transformers.models.qwen3_5.modeling_qwen3_5 import (  # type: ignore[import-not-found]
        torch_chunk_gated_delta_rule,
    )

    return lambda q, k, v, g, beta: torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True
    )[0]


def _run_worker(args: argparse.Namespace) -> dict[str, object]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)

    kernel = _kernel(args.worker)

    gen = torch.Generator().manual_seed(0)

    shape = (args.batch_size, args.seq_len)

    def randn(*dims: int) -> torch.Tensor:
        return torch.randn(*shape, *dims, generator=gen)

    decay_rate = torch.empty(args.num_v_heads).uniform_(0.01, args.max_decay, generator=gen)

    inputs = [
        randn(args.num_heads, args.head_dim),
        randn(args.num_heads, args.head_dim),
        randn(args.num_v_heads, args.head_dim),
        -decay_rate * F.softplus(randn(args.num_v_heads) + 1.0),
        randn(args.num_v_heads).sigmoid(),
    ]

    leaves = [t.requires_grad_() for t in inputs]

    do = randn(args.num_v_heads, args.head_dim)

    input_ptrs = {t.untyped_storage().data_ptr() for t in leaves}

    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()

        if storage.data_ptr() not in input_ptrs:
            saved[storage.data_ptr()] = storage.nbytes()

        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kernel(*leaves)

    baseline_rss = max_rss_mib()

    times, cpu_times = [], []

    for step in range(args.num_warmup + args.num_steps):
        start, cpu_start = time.perf_counter(), time.process_time()

        kernel(*leaves).backward(do)

        if step >= args.num_warmup:
            times.append(time.perf_counter() - start)

            cpu_times.append(time.process_time() - cpu_start)

        for t in leaves:
            t.grad = None

    return {
        "times": times,
        "cpu_times": cpu_times,
        "step_peak_above_inputs_mib": max_rss_mib() - baseline_rss,
        "saved_for_backward_mib": sum(saved.values()) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-v-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--max-decay", type=float, default=16.0)
    parser.add_argument("--num-warmup", type=int, default=2)
    parser.add_argument("--num-steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", choices=["ours", "reference"], help=argparse.SUPPRESS)

    args = parser.parse_args()

    if args.worker is not None:
        print(json.dumps(_run_worker(args)))

        return

    report: dict[str, object] = {
        "config": {name: value for name, value in vars(args).items() if name != "worker"},
        "dtype": "float32",
    }

    # The variants alternate, so a load that comes and goes on a shared
    # machine hits both alike.
    results: dict[str, list[dict[str, Any]]] = {"ours": [], "reference": []}

    for _ in range(args.rounds):
        for variant, variant_results in results.items():
            variant_results.append(spawn_worker(__file__, variant, args))

    for variant, variant_results in results.items():
        times = [t for result in variant_results for t in result["times"]]

        cpu_times = [t for result in variant_results for t in result["cpu_times"]]

        report[variant] = {
            "fwd_bwd_ms": round(1000 * statistics.median(times), 2),
            "fwd_bwd_best_ms": round(1000 * min(times), 2),
            "fwd_bwd_best_cpu_ms": round(1000 * min(cpu_times), 2),
            "step_peak_above_inputs_mib": round(
                max(result["step_peak_above_inputs_mib"] for result in variant_results), 1
            ),
            "saved_for_backward_mib": round(variant_results[0]["saved_for_backward_mib"], 1),
        }

    ours, reference = report["ours"], report["reference"]

    report["speedup"] = round(reference["fwd_bwd_ms"] / ours["fwd_bwd_ms"], 3)  # type: ignore[index]
    report["best_speedup"] = round(reference["fwd_bwd_best_ms"] / ours["fwd_bwd_best_ms"], 3)  # type: ignore[index]
    report["cpu_speedup"] = round(
        reference["fwd_bwd_best_cpu_ms"] / ours["fwd_bwd_best_cpu_ms"], 3  # type: ignore[index]
    )
    report["peak_memory_ratio"] = round(
        ours["step_peak_above_inputs_mib"] / max(reference["step_peak_above_inputs_mib"], 1e-9), 3  # type: ignore[index]
    )
    report["saved_memory_ratio"] = round(
        ours["saved_for_backward_mib"] / reference["saved_for_backward_mib"], 3  # type: ignore[index]
    )
    report["load_average"] = round(os.getloadavg()[0], 2)

    print(json.dumps(report))


if __name__ == "__main__":
    main()
