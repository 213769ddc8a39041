"""Measures where the dense training step spends its time beyond its matmul
floor, module by module.

``train_step.py`` compares the whole step with its floor (the step's
projections as bare GEMMs); this script splits the gap. In one process, on
the model ``train_step.py`` builds (``--shape``), it times forward +
backward of one module of each kind on random inputs (a gradient of ones
for the output) and the bare GEMMs of that module's projections
(``train_step.module_gemm_shapes``), alternately for ``--rounds`` rounds:

- ``gdn``: the Gated DeltaNet mixer of layer 0 (projections, causal
  convolution, delta rule, gated norm);
- ``attention``: the gated attention mixer of the first full-attention layer
  (projections, q/k norms, rotary encoding, SDPA, output gate);
- ``ffn``: the SwiGLU feed-forward network of layer 0;
- ``norm``: the RMSNorm before it.

For each module the report gives its best and median time, the best time
of its GEMMs, the difference (``overhead_ms``) and that difference times the
number of such modules in the model (``overhead_per_step_ms``). Best times
of alternating rounds, because the machines this runs on change speed by
10-20 % within a minute; the modules are timed alone and hot, so the sum of
their overheads estimates, not measures, the step's (``train_step.py``
measures that).

``--compile`` compiles each module (``fullgraph=True``) and the model as the
recipes do. Prints one JSON line. Example::

    .venv/bin/python benchmarks/layer_overhead.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

# The model, its shapes and the timing are the training-step benchmark's.
from train_step import (
    SHAPES,
    BenchConfig,
    cpu_model,
    gemm_step,
    is_full_attention_layer,
    module_gemm_shapes,
    ours_config,
    time_steps_with_cpu,
)


def _alternating_times(steps: dict[str, Callable[[], None]], args: argparse.Namespace) -> dict[str, list[float]]:
    """Runs each of ``steps`` for ``--num-warmup`` untimed and ``--num-steps``
    timed steps, one after the other, ``--rounds`` times; returns the wall
    times in milliseconds of each."""
    times: dict[str, list[float]] = {name: [] for name in steps}

    for _ in range(args.rounds):
        for name, step in steps.items():
            wall, _ = time_steps_with_cpu(step, args.num_warmup, args.num_steps)

            times[name].extend(1000 * t for t in wall)

    return times


def _module_step(module: Any, call: Callable[[Any, Any], Any], x: Any) -> Callable[[], None]:
    """Forward + backward of ``call(module, x)``, with a gradient of ones;
    the gradients are dropped after each step, as a training step does."""
    import torch

    def step() -> None:
        out = call(module, x)

        out.backward(torch.ones_like(out))

        module.zero_grad(set_to_none=True)

        x.grad = None

    return step


def measure_modules(cfg: BenchConfig, args: argparse.Namespace) -> dict[str, Any]:
    """Times the modules and their GEMMs; returns the report's entry of each
    module."""
    import torch

    from fairseq2.models.transformer import AttentionBiasCache
    from fairseq2.nn import BatchLayout

    from qwen35_fs2.models.qwen35 import create_qwen35_model

    torch.manual_seed(0)

    layers = create_qwen35_model(ours_config(cfg)).train().decoder.layers

    attn_idx = next(idx for idx in range(cfg.num_layers) if is_full_attention_layer(cfg, idx))
    gdn_idx = next(idx for idx in range(cfg.num_layers) if not is_full_attention_layer(cfg, idx))

    num_attn = sum(is_full_attention_layer(cfg, idx) for idx in range(cfg.num_layers))

    layout = BatchLayout((cfg.batch_size, cfg.seq_len), None)

    def call_attention(attn: Any, x: Any) -> Any:
        return attn(x, layout, x, layout, x, AttentionBiasCache())

    # name: (module, call, count in the model, the kind of its GEMMs)
    modules: dict[str, tuple[Any, Callable[[Any, Any], Any], int, str | None]] = {
        "gdn": (layers[gdn_idx].linear_attn, lambda m, x: m(x, layout), cfg.num_layers - num_attn, "gdn"),
        "attention": (layers[attn_idx].self_attn, call_attention, num_attn, "attention"),
        "ffn": (layers[gdn_idx].ffn, lambda m, x: m(x), cfg.num_layers, "ffn"),
        # Two in a layer, and the final one.
        "norm": (layers[gdn_idx].ffn_layer_norm, lambda m, x: m(x), 2 * cfg.num_layers + 1, None),
    }

    num_tokens = cfg.batch_size * cfg.seq_len

    x = torch.randn(cfg.batch_size, cfg.seq_len, cfg.model_dim, requires_grad=True)

    shapes = module_gemm_shapes(cfg)

    steps: dict[str, Callable[[], None]] = {}

    for name, (module, call, _, kind) in modules.items():
        if args.compile:
            module = torch.compile(module, fullgraph=True)

        steps[name] = _module_step(module, call, x)

        if kind is not None:
            steps[f"{name}_gemms"] = gemm_step(shapes[kind], num_tokens, "cpu", torch.float32)

    times = _alternating_times(steps, args)

    report: dict[str, Any] = {}

    for name, (_, _, count, kind) in modules.items():
        best = min(times[name])

        gemm = 0.0 if kind is None else min(times[f"{name}_gemms"])

        report[name] = {
            "best_ms": round(best, 2),
            "median_ms": round(statistics.median(times[name]), 2),
            "gemm_ms": round(gemm, 2),
            "overhead_ms": round(best - gemm, 2),
            "count": count,
            "overhead_per_step_ms": round(count * (best - gemm), 1),
        }

    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-warmup", type=int, default=2)
    parser.add_argument("--num-steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seq-len", type=int, help="the tokens of a sequence (default: the shape's, 1024 for `reference`)")
    parser.add_argument("--shape", choices=list(SHAPES), default="reference")
    parser.add_argument("--compile", action="store_true", help="compile each module (fullgraph)")

    return parser


def main() -> None:
    args = build_parser().parse_args()

    cfg = SHAPES[args.shape]

    if args.seq_len is not None:
        cfg = replace(cfg, seq_len=args.seq_len)

    import torch

    torch.set_num_threads(args.threads)

    report = {
        "config": asdict(cfg),
        "threads": args.threads,
        "rounds": args.rounds,
        "compile": args.compile,
        "cpu": cpu_model(),
        "modules": measure_modules(cfg, args),
    }

    print(json.dumps(report))


if __name__ == "__main__":
    main()
