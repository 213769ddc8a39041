"""Measures a training step (forward + backward) of qwen35-fs2 against the
transformers reference, in the same run, and the config's matmul floor.

Each variant runs in a fresh subprocess (so peak memory is per variant):

- ``ours``: our model built by fairseq2 (``Qwen35Config``);
- ``reference``: transformers' ``Qwen3_5ForCausalLM`` from the isolated
  overlay (``QWEN35_HF_REFERENCE_DIR``), fla and causal-conv1d hidden so it
  runs its PyTorch fallbacks on CPU;
- ``floor``: only the step's GEMMs (every projection and the LM head,
  forward and backward) on random tensors of the same shapes.

Prints one JSON line. Example::

    .venv/bin/python benchmarks/train_step.py --threads 2

With ``--profile N`` the report also lists, for ``ours`` and ``reference``,
the N operators with the most self CPU time in one extra profiled step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(kw_only=True)
class BenchConfig:
    """The reference configuration of issue #3 (dense)."""

    model_dim: int = 512
    num_layers: int = 8
    full_attention_interval: int = 4
    num_attn_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_linear_key_heads: int = 4
    num_linear_value_heads: int = 8
    linear_head_dim: int = 64
    ffn_inner_dim: int = 1536
    vocab_size: int = 4096
    batch_size: int = 2
    seq_len: int = 1024


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _time_steps(step: object, num_warmup: int, num_steps: int) -> list[float]:
    for _ in range(num_warmup):
        step()  # type: ignore[operator]

    times = []

    for _ in range(num_steps):
        start = time.perf_counter()

        step()  # type: ignore[operator]

        times.append(time.perf_counter() - start)

    return times


def _profile_step(step: object, top: int) -> list[dict[str, object]]:
    """Runs ``step`` once under the PyTorch profiler; returns the ``top``
    operators by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()  # type: ignore[operator]

    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)

    total_us = sum(e.self_cpu_time_total for e in events)

    return [
        {
            "op": e.key,
            "calls": e.count,
            "self_ms": round(e.self_cpu_time_total / 1000, 1),
            "share": round(e.self_cpu_time_total / total_us, 3),
        }
        for e in events[:top]
    ]


def _measure(step: object, args: argparse.Namespace, baseline_rss: float) -> dict[str, object]:
    """Times ``step``, then profiles it if asked (after the timing, so that
    the profiler does not change the peak memory measured)."""
    result: dict[str, object] = {
        "times": _time_steps(step, args.num_warmup, args.num_steps),
        "baseline_rss_mib": baseline_rss,
        "peak_rss_mib": _max_rss_mib(),
    }

    if args.profile:
        result["profile"] = _profile_step(step, args.profile)

    return result


def ours_config(cfg: BenchConfig) -> Any:
    """Returns the ``Qwen35Config`` of ``cfg`` (untied, PyTorch delta rule)."""
    from qwen35_fs2.models.qwen35 import Qwen35Config

    return Qwen35Config(
        model_dim=cfg.model_dim,
        max_seq_len=cfg.seq_len + 1,
        vocab_size=cfg.vocab_size,
        pad_idx=None,
        tied_embeddings=False,
        num_layers=cfg.num_layers,
        full_attention_interval=cfg.full_attention_interval,
        num_attn_heads=cfg.num_attn_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        num_linear_key_heads=cfg.num_linear_key_heads,
        num_linear_value_heads=cfg.num_linear_value_heads,
        linear_key_head_dim=cfg.linear_head_dim,
        linear_value_head_dim=cfg.linear_head_dim,
        ffn_inner_dim=cfg.ffn_inner_dim,
        gdn_backend="torch",
    )


def _run_ours(cfg: BenchConfig, args: argparse.Namespace) -> dict[str, object]:
    import torch

    from fairseq2.nn import BatchLayout

    from qwen35_fs2.models.qwen35 import create_qwen35_model
    from qwen35_fs2.recipes.loss import install_chunked_lm_loss

    torch.manual_seed(0)

    # The loss the recipes train with.
    model = install_chunked_lm_loss(create_qwen35_model(ours_config(cfg))).train()

    seqs = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1))

    inputs, targets = seqs[:, :-1], seqs[:, 1:]

    layout = BatchLayout.of(inputs)

    baseline_rss = _max_rss_mib()

    def step() -> None:
        loss = model(inputs, layout, targets, reduction="mean")

        loss.backward()

        model.zero_grad(set_to_none=True)

    return _measure(step, args, baseline_rss)


def reference_config(cfg: BenchConfig) -> Any:
    """Returns the transformers ``Qwen3_5TextConfig`` of ``cfg``; hides fla
    and causal-conv1d first, which transformers calls whenever they are
    importable and which fail on CPU."""
    for name in ("fla", "causal_conv1d"):
        sys.modules[name] = None  # type: ignore[assignment]

    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.model_dim,
        num_hidden_layers=cfg.num_layers,
        full_attention_interval=cfg.full_attention_interval,
        num_attention_heads=cfg.num_attn_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        linear_num_key_heads=cfg.num_linear_key_heads,
        linear_num_value_heads=cfg.num_linear_value_heads,
        linear_key_head_dim=cfg.linear_head_dim,
        linear_value_head_dim=cfg.linear_head_dim,
        intermediate_size=cfg.ffn_inner_dim,
        max_position_embeddings=cfg.seq_len + 1,
        tie_word_embeddings=False,
    )


def _run_reference(cfg: BenchConfig, args: argparse.Namespace) -> dict[str, object]:
    config = reference_config(cfg)

    import torch
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)

    model = Qwen3_5ForCausalLM(config).train()

    input_ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len))

    baseline_rss = _max_rss_mib()

    def step() -> None:
        output = model(input_ids=input_ids, labels=input_ids, use_cache=False)

        output.loss.backward()

        model.zero_grad(set_to_none=True)

    return _measure(step, args, baseline_rss)


def gemm_shapes(cfg: BenchConfig) -> list[tuple[int, int]]:
    """Returns ``(input_dim, output_dim)`` of every projection of the step,
    the LM head included."""
    key_dim = cfg.num_linear_key_heads * cfg.linear_head_dim
    value_dim = cfg.num_linear_value_heads * cfg.linear_head_dim

    attn_dim = cfg.num_attn_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim

    d = cfg.model_dim

    gdn = [
        (d, 2 * key_dim + value_dim),
        (d, value_dim),
        (d, cfg.num_linear_value_heads),
        (d, cfg.num_linear_value_heads),
        (value_dim, d),
    ]

    attn = [(d, 2 * attn_dim), (d, kv_dim), (d, kv_dim), (attn_dim, d)]

    ffn = [(d, cfg.ffn_inner_dim), (d, cfg.ffn_inner_dim), (cfg.ffn_inner_dim, d)]

    shapes = []

    for idx in range(cfg.num_layers):
        full = (idx + 1) % cfg.full_attention_interval == 0

        shapes.extend((attn if full else gdn) + ffn)

    shapes.append((d, cfg.vocab_size))

    return shapes


def _run_floor(cfg: BenchConfig, args: argparse.Namespace) -> dict[str, object]:
    import torch

    num_tokens = cfg.batch_size * cfg.seq_len

    torch.manual_seed(0)

    operands = []

    for input_dim, output_dim in gemm_shapes(cfg):
        x = torch.randn(num_tokens, input_dim)
        w = torch.randn(output_dim, input_dim)
        dy = torch.randn(num_tokens, output_dim)

        operands.append((x, w, dy))

    flops = sum(6 * num_tokens * w.size(0) * w.size(1) for _, w, _ in operands)

    def step() -> None:
        for x, w, dy in operands:
            x @ w.t()  # forward
            dy @ w  # input gradient
            dy.t() @ x  # weight gradient

    times = _time_steps(step, args.num_warmup, args.num_steps)

    return {"times": times, "flops": flops}


_WORKERS = {"ours": _run_ours, "reference": _run_reference, "floor": _run_floor}


def cpu_model() -> dict[str, str]:
    """The CPU as ``lscpu`` names it."""
    output = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout

    fields = dict(line.split(":", 1) for line in output.splitlines() if ":" in line)

    keys = {"Model name": "model_name", "CPU family": "family", "Model": "model"}

    return {name: fields[key].strip() for key, name in keys.items() if key in fields}


def spawn_worker(script: str, worker: str, args: argparse.Namespace) -> dict[str, Any]:
    """Runs ``script`` as ``worker`` in a fresh process with the same options
    (but ``--rounds``) and ``args.threads`` threads, the reference workers
    (``reference*``) with the transformers overlay on their path; returns the
    JSON line it prints."""
    env = dict(os.environ)

    threads = str(args.threads)

    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)

    if worker.startswith("reference"):
        overlay = env.get("QWEN35_HF_REFERENCE_DIR", str(REPO_ROOT / ".cache" / "hf-reference"))

        if not Path(overlay, "transformers").is_dir():
            raise SystemExit(
                f"error: the transformers reference overlay is missing at {overlay}; run `make setup`."
            )

        env["PYTHONPATH"] = overlay

    cmd = [sys.executable, script, "--worker", worker] + [
        f"--{name.replace('_', '-')}={value}"
        for name, value in vars(args).items()
        if name not in ("worker", "rounds")
    ]

    result = subprocess.run(cmd, env=env, capture_output=True, text=True)

    if result.returncode != 0:
        raise SystemExit(f"error: the {worker} worker failed:\n{result.stderr}")

    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-warmup", type=int, default=1)
    parser.add_argument("--num-steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="list the N operators with the most self CPU time")
    parser.add_argument("--worker", choices=list(_WORKERS), help=argparse.SUPPRESS)

    args = parser.parse_args()

    cfg = BenchConfig(seq_len=args.seq_len)

    if args.worker is not None:
        import torch

        torch.set_num_threads(args.threads)

        result = _WORKERS[args.worker](cfg, args)

        print(json.dumps(result))

        return

    num_tokens = cfg.batch_size * cfg.seq_len

    report: dict[str, object] = {"config": asdict(cfg), "threads": args.threads}

    for worker in ("floor", "ours", "reference"):
        result = spawn_worker(__file__, worker, args)

        step_s = statistics.median(result["times"])  # type: ignore[arg-type]

        entry: dict[str, object] = {
            "step_s": round(step_s, 4),
            "tokens_per_s": round(num_tokens / step_s, 1),
        }

        if "peak_rss_mib" in result:
            entry["peak_rss_mib"] = round(result["peak_rss_mib"], 1)  # type: ignore[arg-type]
            entry["step_peak_above_init_mib"] = round(
                result["peak_rss_mib"] - result["baseline_rss_mib"], 1  # type: ignore[operator]
            )

        if "flops" in result:
            entry["gflop_per_s"] = round(result["flops"] / step_s / 1e9, 1)  # type: ignore[operator]

        if "profile" in result:
            entry["profile"] = result["profile"]

        report[worker] = entry

    ours, reference, floor = report["ours"], report["reference"], report["floor"]

    report["speedup_vs_reference"] = round(ours["tokens_per_s"] / reference["tokens_per_s"], 3)  # type: ignore[index]
    report["ours_fraction_of_floor"] = round(ours["tokens_per_s"] / floor["tokens_per_s"], 3)  # type: ignore[index]
    report["reference_fraction_of_floor"] = round(reference["tokens_per_s"] / floor["tokens_per_s"], 3)  # type: ignore[index]

    print(json.dumps(report))


if __name__ == "__main__":
    main()
