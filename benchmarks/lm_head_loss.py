"""Measures the LM-head loss, forward + backward, at the LM-head shapes of
Qwen3.5-27B (vocabulary 248,320, model dimension 5,120), for a short batch.

Each variant runs in a fresh subprocess (so peak memory is per variant), on
the same inputs: a bf16 (``--dtype``) projection weight drawn from N(0,
0.02^2), decoder outputs from N(0, 1), uniform targets, a summed loss (as our
units compute it):

- ``ours``: :func:`qwen35_fs2.recipes.loss.chunked_cross_entropy` through a
  fairseq2 ``Linear`` (the fused path);
- ``previous``: the same function as of ``--previous-rev``, read from the git
  history of the checkout: the fused path before it moved the gradients to
  the backward pass (it computed them in the forward pass and kept them);
- ``fairseq2``: what :meth:`TransformerLM.compute_fused_loss` computes, the
  full logits and ``fairseq2.nn.functional.cross_entropy``;
- ``floor``: the three GEMMs of the loss (the logits, the gradients of the
  decoder output and of the weight) on tensors of the same shapes, in fp32
  for bf16 and fp16 (as the loss multiplies them on the CPU).

Reported per variant: the wall and CPU time of the forward and backward
passes (median over ``--num-steps`` after ``--num-warmup``); the memory above
the inputs (resident, so allocator caching included) at the forward pass's
peak, held between the forward and the backward pass (while a model's
activations peak), and at the step's peak (which includes the weight's
gradient, ``weight_grad_mib``, that every variant must produce); and the
bytes autograd keeps for the backward beyond the inputs (deterministic).
Prints one JSON line. Example::

    .venv/bin/python benchmarks/lm_head_loss.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
import types
from collections.abc import Callable
from typing import Any

# The process handling is shared with the training-step benchmarks.
from train_step import REPO_ROOT, max_rss_mib, spawn_worker

PREVIOUS_REV = "e2700f58bfe531601e1e643c5fd5eb052cdaef40"

# Where the loss module was at `PREVIOUS_REV` (it is `recipes/loss.py` since).
PREVIOUS_LOSS_PATH = "src/qwen35_fs2/models/loss.py"

VARIANTS = ("ours", "previous", "fairseq2", "floor")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])

    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _read_previous_loss(rev: str) -> str:
    result = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "show", f"{rev}:{PREVIOUS_LOSS_PATH}"], capture_output=True, text=True
    )

    if result.returncode != 0:
        raise SystemExit(
            f"error: `--previous-rev` {rev} must name a commit of this checkout's history, but `git show` failed: {result.stderr.strip()} Fetch the history, or leave `previous` out of `--variants`."
        )

    return result.stdout


def _loss_fn(args: argparse.Namespace) -> Callable[[Any, Any, Any], Any]:
    """Returns ``fn(x, proj, targets)``, the summed loss of the variant."""
    if args.worker == "fairseq2":
        from fairseq2.nn.functional import cross_entropy

        return lambda x, proj, targets: cross_entropy(proj(x), targets, None)

    if args.worker == "ours":
        from qwen35_fs2.recipes.loss import chunked_cross_entropy
    else:
        # The module imports only torch and fairseq2.
        previous = types.ModuleType("previous_loss")

        exec(compile(_read_previous_loss(args.previous_rev), f"{args.previous_rev[:12]}:{PREVIOUS_LOSS_PATH}", "exec"), previous.__dict__)

        chunked_cross_entropy = previous.chunked_cross_entropy

    return lambda x, proj, targets: chunked_cross_entropy(x, proj, targets, None, chunk_size=args.chunk_size)


def _run_worker(args: argparse.Namespace) -> dict[str, object]:
    import torch

    from fairseq2.nn import Linear

    torch.set_num_threads(args.threads)

    dtype = getattr(torch, args.dtype)

    gen = torch.Generator().manual_seed(0)

    def init_weight(proj: Linear) -> None:
        # In place: no temporary of the weight's size raises the peak.
        torch.nn.init.normal_(proj.weight, std=0.02, generator=gen)

    proj = Linear(args.model_dim, args.vocab_size, bias=False, init_fn=init_weight, dtype=dtype)

    x = torch.randn(args.num_tokens, args.model_dim, generator=gen).to(dtype).requires_grad_()

    targets = torch.randint(0, args.vocab_size, (args.num_tokens,), generator=gen)

    leaves = [x, proj.weight]

    input_ptrs = {t.untyped_storage().data_ptr() for t in (*leaves, targets)}

    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()

        if storage.data_ptr() not in input_ptrs:
            saved[storage.data_ptr()] = storage.nbytes()

        return t

    if args.worker == "floor":
        # On the CPU, bf16 and fp16 operands multiplied as fp32 products of
        # their values, as the loss multiplies them there (PyTorch's own
        # products in these dtypes run in scalar code on CPUs without
        # AVX-512: docs/performance.md, "The LM-head loss's bf16 products in
        # fp32 on the CPU"); the copies are made before the steps.
        floor_x, floor_weight = x.detach().float(), proj.weight.detach().float()

        def forward() -> Any:
            return floor_x @ floor_weight.t()

        def backward(logits: Any) -> None:
            # The logits stand in for their gradient.
            logits @ floor_weight

            logits.t() @ floor_x

    else:
        loss_fn = _loss_fn(args)

        def forward() -> Any:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return loss_fn(x, proj, targets)

        def backward(loss: Any) -> None:
            loss.backward()

    inputs_rss = _rss_mib()

    startup_peak = max_rss_mib()

    fwd_times, bwd_times, cpu_times = [], [], []

    forward_peak = held_after_forward = 0.0

    for step in range(args.num_warmup + args.num_steps):
        start, cpu_start = time.perf_counter(), time.process_time()

        out = forward()

        middle = time.perf_counter()

        if step == 0:
            forward_peak = max_rss_mib() - inputs_rss

            held_after_forward = _rss_mib() - inputs_rss

        backward(out)

        del out

        if step >= args.num_warmup:
            fwd_times.append(middle - start)

            bwd_times.append(time.perf_counter() - middle)

            cpu_times.append(time.process_time() - cpu_start)

        for t in leaves:
            t.grad = None

    return {
        "fwd_times": fwd_times,
        "bwd_times": bwd_times,
        "cpu_times": cpu_times,
        "inputs_rss_mib": inputs_rss,
        "startup_peak_mib": startup_peak,
        "forward_peak_above_inputs_mib": forward_peak,
        "held_after_forward_mib": held_after_forward,
        "step_peak_above_inputs_mib": max_rss_mib() - inputs_rss,
        "saved_for_backward_mib": sum(saved.values()) / 2**20,
        "weight_grad_mib": proj.weight.numel() * proj.weight.element_size() / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=248_320)
    parser.add_argument("--model-dim", type=int, default=5_120)
    parser.add_argument("--num-tokens", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=256, help="`chunk_size` of the chunked losses")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--num-warmup", type=int, default=1)
    parser.add_argument("--num-steps", type=int, default=1)
    parser.add_argument("--previous-rev", default=PREVIOUS_REV)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="a comma-separated subset of " + ", ".join(VARIANTS))
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)

    args = parser.parse_args()

    if args.worker is not None:
        print(json.dumps(_run_worker(args)))

        return

    variants = args.variants.split(",")

    for variant in variants:
        if variant not in VARIANTS:
            raise SystemExit(f"error: `--variants` must list some of {', '.join(VARIANTS)}, but includes '{variant}' instead.")

    if "previous" in variants:
        # Fails early, before the long runs, if the history is missing.
        _read_previous_loss(args.previous_rev)

    report: dict[str, object] = {
        "config": {name: value for name, value in vars(args).items() if name not in ("worker", "variants")},
    }

    # Sequential, one variant at a time: each holds several GiB.
    for variant in variants:
        result = spawn_worker(__file__, variant, args)

        def ms(times: list[float]) -> float:
            return round(1000 * statistics.median(times), 1)

        report[variant] = {
            "fwd_ms": ms(result["fwd_times"]),
            "bwd_ms": ms(result["bwd_times"]),
            "fwd_bwd_ms": ms([f + b for f, b in zip(result["fwd_times"], result["bwd_times"])]),
            "fwd_bwd_cpu_ms": ms(result["cpu_times"]),
            **{
                name: round(result[name], 1)
                for name in (
                    "inputs_rss_mib",
                    "startup_peak_mib",
                    "forward_peak_above_inputs_mib",
                    "held_after_forward_mib",
                    "step_peak_above_inputs_mib",
                    "saved_for_backward_mib",
                    "weight_grad_mib",
                )
            },
        }

    if "floor" in report:
        floor = report["floor"]

        # CPU time is the steadier of the two on a shared machine.
        for variant in variants:
            for key, time_key in (("fraction_of_floor", "fwd_bwd_ms"), ("cpu_fraction_of_floor", "fwd_bwd_cpu_ms")):
                report[variant][key] = round(floor[time_key] / report[variant][time_key], 3)  # type: ignore[index]

    report["load_average"] = round(os.getloadavg()[0], 2)

    print(json.dumps(report))


if __name__ == "__main__":
    main()
