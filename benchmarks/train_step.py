"""Measures a training step (forward + backward) of qwen35-fs2 against the
transformers reference, in the same run, and the config's matmul floor.

Each variant runs in a fresh subprocess (so peak memory is per variant):

- ``ours``: our model built by fairseq2 (``Qwen35Config``);
- ``reference``: transformers' ``Qwen3_5ForCausalLM`` from the isolated
  overlay (``QWEN35_HF_REFERENCE_DIR``), fla and causal-conv1d hidden so it
  runs its PyTorch fallbacks on CPU;
- ``floor``: only the step's GEMMs (every projection and the LM head,
  forward and backward) on random tensors of the same shapes.

Each variant runs ``--rounds`` times, interleaved with the others, and the
fastest step of all its rounds counts (``step_s``; ``median_step_s`` beside
it): on a shared machine the load changes between variants, and the best
step is the least disturbed one. Wall time and CPU time of all threads
(``cpu_step_s``) are reported; the latter suffers less from other processes.

Prints one JSON line. Example::

    .venv/bin/python benchmarks/train_step.py --threads 2 --rounds 3

With ``--profile N`` the report also lists, for ``ours`` and ``reference``,
the N operators with the most self CPU time in one extra profiled step.

On a GPU, ``--device cuda`` runs ``floor`` and ``ours`` (``--variants``) as
they train there: ``--dtype bf16`` (fp32 weights under bf16
``torch.autocast``, the recipes' mixed precision on one device),
``--backend fla`` (fla's kernels in the Gated DeltaNet layers), ``--compile``
(the recipes' ``compile: true``), and ``--shape 0.8b-4k`` (Qwen3.5-0.8B, one
sequence of 4,096 tokens). The steps are timed between
``torch.cuda.synchronize()`` calls, and the report adds the peak CUDA memory
and the MFU (:func:`model_flops` per second over :func:`bf16_peak_flops`).
``make gpu-check`` (``scripts/gpu_check.py``) runs these configurations.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Final, Protocol

REPO_ROOT = Path(__file__).resolve().parent.parent

VARIANTS: Final = ("floor", "ours", "reference")
"""The variants of the benchmarks, in the order they run."""


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
    tied_embeddings: bool = False
    batch_size: int = 2
    seq_len: int = 1024


SHAPES: Final = {
    "reference": BenchConfig(),
    # Qwen3.5-0.8B (the `qwen35_0.8b` architecture) on one sequence of 4,096
    # tokens.
    "0.8b-4k": BenchConfig(
        model_dim=1024,
        num_layers=24,
        head_dim=256,
        num_linear_key_heads=16,
        num_linear_value_heads=16,
        linear_head_dim=128,
        ffn_inner_dim=3584,
        vocab_size=248_320,
        tied_embeddings=True,
        batch_size=1,
        seq_len=4096,
    ),
}
"""The shapes of ``--shape``."""

# Dense (no sparsity) bf16 Tensor Core peaks in FLOP/s: the words that name
# the GPU in `torch.cuda.get_device_name()`, the peak, and where it comes
# from. NVIDIA's data sheets give Hopper's peaks "with sparsity", twice the
# dense rate; the first match counts.
_BF16_PEAK_FLOPS: Final = (
    (("H100", "PCIe"), 1513e12 / 2, "NVIDIA H100 data sheet: 1,513 TFLOPS bf16 with sparsity (H100 PCIe), halved"),
    (("H100", "NVL"), 1671e12 / 2, "NVIDIA H100 data sheet: 1,671 TFLOPS bf16 with sparsity (H100 NVL), halved"),
    (("H100",), 1979e12 / 2, "NVIDIA H100 data sheet: 1,979 TFLOPS bf16 with sparsity (H100 SXM), halved"),
    (("H200", "NVL"), 1671e12 / 2, "NVIDIA H200 data sheet: 1,671 TFLOPS bf16 with sparsity (H200 NVL), halved"),
    (("H200",), 1979e12 / 2, "NVIDIA H200 data sheet: 1,979 TFLOPS bf16 with sparsity (H200 SXM), halved"),
    (("A100",), 312e12, "NVIDIA A100 data sheet: 312 TFLOPS bf16 (dense)"),
)


def bf16_peak_flops(device_name: str) -> tuple[float | None, str]:
    """Returns the dense bf16 peak FLOP/s of the GPU that
    ``torch.cuda.get_device_name()`` calls ``device_name``, and where the
    number comes from; or ``None`` and why there is none."""
    words = re.split(r"[\s-]+", device_name)

    if "MIG" in words:
        return None, f"'{device_name}' is a MIG slice of a GPU, whose share of the GPU's peak is not known here."

    for names, peak, source in _BF16_PEAK_FLOPS:
        if all(name in words for name in names):
            return peak, source

    known = ", ".join(" ".join(names) for names, _, _ in _BF16_PEAK_FLOPS)

    return None, (
        f"No bf16 peak is known for '{device_name}' (known: {known}); add it to "
        "`_BF16_PEAK_FLOPS` in benchmarks/train_step.py."
    )


def mfu_peak(device_name: str, dtype: str) -> tuple[float | None, str]:
    """Returns the peak FLOP/s the MFU of a run in ``dtype`` on
    ``device_name`` is measured against, and where it comes from; or
    ``None`` and why there is none."""
    if dtype != "bf16":
        return None, f"MFU is measured against the GPU's bf16 peak, but this run is {dtype}."

    return bf16_peak_flops(device_name)


def causal_attention_flops(
    *, num_layers: int, num_heads: int, head_dim: int, batch_size: int, seq_len: int
) -> int:
    """Returns the FLOPs of the score and value products of ``num_layers``
    causal attention layers, forward and backward: each product is
    ``2 * S * S * head_dim`` FLOPs a head, halved by the causal mask, and the
    backward pass has two products for each of the forward pass."""
    return 3 * 2 * (2 * seq_len * seq_len * head_dim // 2) * num_heads * batch_size * num_layers


class AttentionShape(Protocol):
    """What :func:`full_attention_flops` reads of a benchmark config, dense
    or MoE."""

    num_layers: int
    full_attention_interval: int
    num_attn_heads: int
    head_dim: int
    batch_size: int
    seq_len: int


def is_full_attention_layer(cfg: AttentionShape, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` of ``cfg`` is a full-attention layer."""
    return (layer_idx + 1) % cfg.full_attention_interval == 0


def full_attention_flops(cfg: AttentionShape) -> int:
    """Returns :func:`causal_attention_flops` of the full-attention layers of
    ``cfg`` (every ``full_attention_interval``-th layer)."""
    num_full_layers = sum(is_full_attention_layer(cfg, idx) for idx in range(cfg.num_layers))

    return causal_attention_flops(
        num_layers=num_full_layers,
        num_heads=cfg.num_attn_heads,
        head_dim=cfg.head_dim,
        batch_size=cfg.batch_size,
        seq_len=cfg.seq_len,
    )


def add_step_options(parser: argparse.ArgumentParser) -> None:
    """Adds the options of both training-step benchmarks that choose how
    long and how often they measure."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-warmup", type=int, default=1)
    parser.add_argument("--num-steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, help="the tokens of a sequence (default: the shape's, 1024 for `reference`)")
    parser.add_argument("--rounds", type=int, default=1, help="run the variants this many times, interleaved; the fastest step counts")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="list the N operators with the most self CPU time")


def add_run_options(parser: argparse.ArgumentParser, shapes: Iterable[str]) -> None:
    """Adds the options of both training-step benchmarks that choose the
    device, the precision, the kernels, compilation and the shape."""
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: fp32 weights under bf16 autocast, as the recipes train on one device"
    )
    parser.add_argument("--backend", choices=["torch", "fla"], default="torch", help="the kernels of the Gated DeltaNet layers of `ours`")
    parser.add_argument("--compile", action="store_true", help="compile `ours` as the recipes' `compile: true` does")
    parser.add_argument("--shape", choices=list(shapes), default="reference")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="a comma-separated subset of " + ", ".join(VARIANTS))


def check_run_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """Exits with an error on options that cannot go together; returns the
    variants to run, in the order of :data:`VARIANTS`."""
    variants = args.variants.split(",")

    for variant in variants:
        if variant not in VARIANTS:
            parser.error(f"`--variants` must list some of {', '.join(VARIANTS)}, but includes '{variant}' instead.")

    if args.backend == "fla" and args.device != "cuda":
        parser.error(
            f"`--backend fla` needs `--device cuda` (fla's Triton kernels run on CPU only under Triton's interpreter, for tests), but `--device` is {args.device} instead."
        )

    if "reference" in variants:
        if args.device != "cpu":
            parser.error(
                f"`--variants` must leave out `reference` with `--device {args.device}`: the transformers reference runs its PyTorch fallbacks on CPU."
            )

        if args.compile:
            parser.error("`--variants` must leave out `reference` with `--compile`, which compiles `ours` only.")

    if args.profile and args.device != "cpu":
        parser.error(f"`--profile` lists self CPU time and needs `--device cpu`, but `--device` is {args.device} instead.")

    return [variant for variant in VARIANTS if variant in variants]


def worker_device(args: argparse.Namespace) -> Any:
    """Returns the ``torch.device`` of ``--device``; exits with an error if
    it is CUDA and none is visible."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"error: `--device cuda` needs a CUDA device, but torch {torch.__version__} (CUDA {torch.version.cuda}) sees none."
        )

    return torch.device(args.device)


def step_context(args: argparse.Namespace, device: Any) -> AbstractContextManager[object]:
    """Returns the context of a step's forward pass: bf16 autocast for
    ``--dtype bf16`` (fp32 weights, as fairseq2's trainer runs static mixed
    precision on one device), nothing for fp32."""
    import torch

    if args.dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)

    return nullcontext()


def prepare_model(model: Any, args: argparse.Namespace, device: Any) -> Any:
    """Moves ``model`` (its loss installed) to ``device`` (what its
    creation under ``with device`` left elsewhere) and compiles it for
    ``--compile`` with fairseq2's model compiler and the recipes' default
    ``compile_options`` (which are ``torch.compile``'s own)."""
    from fairseq2.models.transformer_lm import compile_transformer_lm

    model.to(device)

    if args.compile:
        compile_transformer_lm(model)

    return model


def _no_sync() -> None:
    pass


def synchronizer(device: Any) -> Callable[[], None]:
    """Returns the function that waits for the work queued on ``device``,
    so that a step's time covers its kernels (CUDA runs them
    asynchronously)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.synchronize

    return _no_sync


def start_cuda_stats(device: Any) -> Callable[[], dict[str, object]]:
    """Starts CUDA's peak-memory statistics afresh (call it with the model
    and batch built) and returns the function that reads them after the
    steps, with the GPU's name: the memory allocated before the first step,
    and the peaks of what tensors took (``max_memory_allocated``) and of
    what the caching allocator held (``max_memory_reserved``), in MiB.
    Nothing on CPU."""
    import torch

    if device.type != "cuda":
        return lambda: {}

    torch.cuda.synchronize()

    torch.cuda.reset_peak_memory_stats(device)

    baseline = torch.cuda.memory_allocated(device) / 2**20

    def read() -> dict[str, object]:
        return {
            "device_name": torch.cuda.get_device_name(device),
            "cuda_baseline_mib": baseline,
            "peak_cuda_mib": torch.cuda.max_memory_allocated(device) / 2**20,
            "peak_cuda_reserved_mib": torch.cuda.max_memory_reserved(device) / 2**20,
        }

    return read


def compile_stats() -> dict[str, int]:
    """Returns how many graphs dynamo compiled in this process and how many
    graph breaks it met."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


def max_rss_mib() -> float:
    """The process's peak resident memory so far in MiB (``ru_maxrss``,
    which never decreases: differences of two readings are peaks above a
    baseline)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _time_steps(step: object, num_warmup: int, num_steps: int, sync: Callable[[], None] = _no_sync) -> list[float]:
    for _ in range(num_warmup):
        step()  # type: ignore[operator]

    sync()

    times = []

    for _ in range(num_steps):
        start = time.perf_counter()

        step()  # type: ignore[operator]

        sync()

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


def time_steps_with_cpu(
    step: Callable[[], None], num_warmup: int, num_steps: int, sync: Callable[[], None] = _no_sync
) -> tuple[list[float], list[float]]:
    """Returns the wall times of ``_time_steps`` and the CPU times (all
    threads) of the same steps; on a shared machine the CPU time is the
    steadier of the two."""
    cpu_times = []

    def timed_step() -> None:
        start = time.process_time()

        step()

        sync()

        cpu_times.append(time.process_time() - start)

    times = _time_steps(timed_step, num_warmup, num_steps, sync)

    return times, cpu_times[num_warmup:]


def measure(step: Callable[[], None], args: argparse.Namespace, device: Any, baseline_rss: float) -> dict[str, Any]:
    """Times the model's ``step`` in wall and CPU time, with its peak
    memory, then profiles it for ``--profile`` (after the timing, so that
    the profiler does not change the peak memory measured)."""
    sync = synchronizer(device)

    read_cuda_stats = start_cuda_stats(device)

    # Timed apart from the steps: with `--compile` or fla's autotuning the
    # first step is mostly compilation.
    warmup_times, _ = time_steps_with_cpu(step, 0, args.num_warmup, sync)

    times, cpu_times = time_steps_with_cpu(step, 0, args.num_steps, sync)

    result: dict[str, Any] = {
        "warmup_times": warmup_times,
        "times": times,
        "cpu_times": cpu_times,
        "baseline_rss_mib": baseline_rss,
        "peak_rss_mib": max_rss_mib(),
        **read_cuda_stats(),
    }

    if args.compile:
        result["compile"] = compile_stats()

    if args.profile:
        result["profile"] = _profile_step(step, args.profile)

    return result


def ours_config(cfg: BenchConfig, backend: str = "torch") -> Any:
    """Returns the ``Qwen35Config`` of ``cfg`` with the Gated DeltaNet
    kernels of ``backend``."""
    from qwen35_fs2.models.qwen35 import Qwen35Config

    return Qwen35Config(
        model_dim=cfg.model_dim,
        max_seq_len=cfg.seq_len + 1,
        vocab_size=cfg.vocab_size,
        pad_idx=None,
        tied_embeddings=cfg.tied_embeddings,
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
        gdn_backend=backend,  # type: ignore[arg-type]
    )


def _run_ours(cfg: BenchConfig, args: argparse.Namespace) -> dict[str, object]:
    import torch

    from fairseq2.nn import BatchLayout

    from qwen35_fs2.models.qwen35 import create_qwen35_model
    from qwen35_fs2.recipes.loss import install_chunked_lm_loss

    device = worker_device(args)

    torch.manual_seed(0)

    # On the device, as fairseq2 creates models.
    with device:
        model = create_qwen35_model(ours_config(cfg, args.backend))

    # The loss the recipes train with.
    model = prepare_model(install_chunked_lm_loss(model).train(), args, device)

    seqs = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), device=device)

    inputs, targets = seqs[:, :-1], seqs[:, 1:]

    layout = BatchLayout.of(inputs)

    baseline_rss = max_rss_mib()

    def step() -> None:
        with step_context(args, device):
            loss = model(inputs, layout, targets, reduction="mean")

        loss.backward()

        model.zero_grad(set_to_none=True)

    return measure(step, args, device, baseline_rss)


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
        tie_word_embeddings=cfg.tied_embeddings,
    )


def _run_reference(cfg: BenchConfig, args: argparse.Namespace) -> dict[str, object]:
    config = reference_config(cfg)

    import torch
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)

    model = Qwen3_5ForCausalLM(config).train()

    input_ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len))

    device = torch.device("cpu")

    baseline_rss = max_rss_mib()

    def step() -> None:
        with step_context(args, device):
            output = model(input_ids=input_ids, labels=input_ids, use_cache=False)

        output.loss.backward()

        model.zero_grad(set_to_none=True)

    return measure(step, args, device, baseline_rss)


def module_gemm_shapes(cfg: BenchConfig) -> dict[str, list[tuple[int, int]]]:
    """Returns ``(input_dim, output_dim)`` of the projections of each kind of
    module of the step: ``gdn`` (a Gated DeltaNet mixer), ``attention`` (a
    gated attention mixer), ``ffn`` and ``lm_head``."""
    key_dim = cfg.num_linear_key_heads * cfg.linear_head_dim
    value_dim = cfg.num_linear_value_heads * cfg.linear_head_dim

    attn_dim = cfg.num_attn_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim

    d = cfg.model_dim

    return {
        "gdn": [
            (d, 2 * key_dim + value_dim),
            (d, value_dim),
            (d, cfg.num_linear_value_heads),
            (d, cfg.num_linear_value_heads),
            (value_dim, d),
        ],
        "attention": [(d, 2 * attn_dim), (d, kv_dim), (d, kv_dim), (attn_dim, d)],
        "ffn": [(d, cfg.ffn_inner_dim), (d, cfg.ffn_inner_dim), (cfg.ffn_inner_dim, d)],
        "lm_head": [(d, cfg.vocab_size)],
    }


def gemm_shapes(cfg: BenchConfig) -> list[tuple[int, int]]:
    """Returns ``(input_dim, output_dim)`` of every projection of the step,
    the LM head included."""
    modules = module_gemm_shapes(cfg)

    shapes = []

    for idx in range(cfg.num_layers):
        mixer = "attention" if is_full_attention_layer(cfg, idx) else "gdn"

        shapes.extend(modules[mixer] + modules["ffn"])

    shapes.extend(modules["lm_head"])

    return shapes


def gemm_step(shapes: Iterable[tuple[int, int]], num_tokens: int, device: Any, dtype: Any) -> Callable[[], None]:
    """Returns a step of the GEMMs of projections of ``shapes`` on
    ``num_tokens`` tokens, forward and backward (the output, the input
    gradient and the weight gradient), on random tensors."""
    import torch

    operands = []

    for input_dim, output_dim in shapes:
        x = torch.randn(num_tokens, input_dim, device=device, dtype=dtype)
        w = torch.randn(output_dim, input_dim, device=device, dtype=dtype)
        dy = torch.randn(num_tokens, output_dim, device=device, dtype=dtype)

        operands.append((x, w, dy))

    def step() -> None:
        for x, w, dy in operands:
            x @ w.t()  # forward
            dy @ w  # input gradient
            dy.t() @ x  # weight gradient

    return step


def gemm_flops(cfg: BenchConfig) -> int:
    """Returns the FLOPs of the GEMMs of :func:`gemm_shapes`, forward and
    backward (three products of ``2 * tokens * input_dim * output_dim``)."""
    num_tokens = cfg.batch_size * cfg.seq_len

    return sum(6 * num_tokens * input_dim * output_dim for input_dim, output_dim in gemm_shapes(cfg))


def model_flops(cfg: BenchConfig) -> int:
    """Returns the FLOPs of a training step that MFU counts: the GEMMs and
    the causal attention of the full-attention layers. The Gated DeltaNet
    recurrence (about 2 % of the step at the 0.8b-4k shape), the
    convolutions, norms and the softmax are left out, as MFU's "model
    FLOPs" leave out everything but the matrix products."""
    return gemm_flops(cfg) + full_attention_flops(cfg)


def _run_floor(cfg: BenchConfig, args: argparse.Namespace) -> dict[str, object]:
    import torch

    device = worker_device(args)

    # The dtype autocast runs the GEMMs in.
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    torch.manual_seed(0)

    step = gemm_step(gemm_shapes(cfg), cfg.batch_size * cfg.seq_len, device, dtype)

    sync = synchronizer(device)

    read_cuda_stats = start_cuda_stats(device)

    warmup_times, _ = time_steps_with_cpu(step, 0, args.num_warmup, sync)

    times, cpu_times = time_steps_with_cpu(step, 0, args.num_steps, sync)

    return {
        "warmup_times": warmup_times,
        "times": times,
        "cpu_times": cpu_times,
        "flops": gemm_flops(cfg),
        **read_cuda_stats(),
    }


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

    cmd = [sys.executable, script, "--worker", worker]

    for name, value in vars(args).items():
        # Unset options keep their default; flags are passed by name.
        if name in ("worker", "rounds") or value is None or value is False:
            continue

        option = f"--{name.replace('_', '-')}"

        cmd.append(option if value is True else f"{option}={value}")

    result = subprocess.run(cmd, env=env, capture_output=True, text=True)

    if result.returncode != 0:
        raise SystemExit(f"error: the {worker} worker failed:\n{result.stderr}")

    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run_header(args: argparse.Namespace, results: Iterable[dict[str, Any]]) -> tuple[dict[str, object], float | None]:
    """Returns the report's fields that describe the run (its options, and
    on CUDA the GPU and the peak its MFU is measured against), and that
    peak in FLOP/s (``None`` on CPU or where it is not known)."""
    header: dict[str, object] = {name: getattr(args, name) for name in ("device", "dtype", "backend", "compile", "shape")}

    if args.device != "cuda":
        return header, None

    device_name = next(iter(results))["device_name"]

    peak, note = mfu_peak(device_name, args.dtype)

    header["device_name"] = device_name

    header["mfu_peak_tflop_per_s"] = None if peak is None else round(peak / 1e12, 1)

    header["mfu_peak_source" if peak is not None else "mfu_unavailable"] = note

    return header, peak


def run_fields(result: dict[str, Any], flops: int, step_s: float, peak: float | None) -> dict[str, object]:
    """Returns the fields of a variant's entry beyond its speed: its
    warm-up steps, what compilation did, and on CUDA its peak memory, its
    FLOP/s (``flops`` a step) and its MFU (``None`` without a peak)."""
    fields: dict[str, object] = {"warmup_step_s": [round(t, 4) for t in result["warmup_times"]]}

    if "compile" in result:
        fields["compile"] = result["compile"]

    if "device_name" not in result:
        return fields

    flop_per_s = flops / step_s

    fields.update(
        peak_cuda_mib=round(result["peak_cuda_mib"], 1),
        peak_cuda_reserved_mib=round(result["peak_cuda_reserved_mib"], 1),
        cuda_step_peak_above_init_mib=round(result["peak_cuda_mib"] - result["cuda_baseline_mib"], 1),
        tflop_per_s=round(flop_per_s / 1e12, 2),
        mfu=None if peak is None else round(flop_per_s / peak, 4),
    )

    return fields


def run_rounds(script: str, args: argparse.Namespace, cfg: Any, variants: list[str], model_flops: int) -> dict[str, Any]:
    """Runs ``script``'s ``variants`` in fresh processes, ``--rounds`` times
    interleaved, and returns the report: per variant its fastest step of all
    rounds (the memory and profile of that round), the median step and the
    fastest CPU time; then the speedup over the reference and the fractions
    of the floor, in wall and CPU time.

    :param cfg: The benchmark's configuration (a dataclass with
        ``batch_size`` and ``seq_len``).
    :param model_flops: The FLOPs of a step of ``ours`` and ``reference``
        that their MFU counts.
    """
    num_tokens = cfg.batch_size * cfg.seq_len

    results: dict[str, list[dict[str, Any]]] = {variant: [] for variant in variants}

    for _ in range(args.rounds):
        for worker, worker_results in results.items():
            worker_results.append(spawn_worker(script, worker, args))

    header, peak = run_header(args, (r[0] for r in results.values()))

    report: dict[str, Any] = {
        "config": asdict(cfg),
        "threads": args.threads,
        "rounds": args.rounds,
        "cpu": cpu_model(),
        **header,
    }

    for worker, worker_results in results.items():
        times = [t for r in worker_results for t in r["times"]]

        step_s = min(times)

        # The round with the fastest step.
        result = next(r for r in worker_results if step_s in r["times"])

        entry: dict[str, Any] = {
            "step_s": round(step_s, 4),
            "median_step_s": round(statistics.median(times), 4),
            "tokens_per_s": round(num_tokens / step_s, 1),
            "cpu_step_s": round(min(t for r in worker_results for t in r["cpu_times"]), 4),
        }

        if "peak_rss_mib" in result:
            entry["peak_rss_mib"] = round(result["peak_rss_mib"], 1)
            entry["step_peak_above_init_mib"] = round(result["peak_rss_mib"] - result["baseline_rss_mib"], 1)

        if "flops" in result:
            entry["gflop_per_s"] = round(result["flops"] / step_s / 1e9, 1)

        if "profile" in result:
            entry["profile"] = result["profile"]

        flops = result["flops"] if worker == "floor" else model_flops

        entry.update(run_fields(result, flops, step_s, peak))

        report[worker] = entry

    ours, reference, floor = report.get("ours"), report.get("reference"), report.get("floor")

    if ours is not None and reference is not None:
        report["speedup_vs_reference"] = round(ours["tokens_per_s"] / reference["tokens_per_s"], 3)
        report["cpu_speedup_vs_reference"] = round(reference["cpu_step_s"] / ours["cpu_step_s"], 3)

    if floor is not None:
        for worker, entry in (("ours", ours), ("reference", reference)):
            if entry is not None:
                report[f"{worker}_fraction_of_floor"] = round(entry["tokens_per_s"] / floor["tokens_per_s"], 3)
                report[f"{worker}_cpu_fraction_of_floor"] = round(floor["cpu_step_s"] / entry["cpu_step_s"], 3)

    return report


def run_benchmark(
    script: str,
    args: argparse.Namespace,
    variants: list[str],
    cfg: Any,
    workers: dict[str, Callable[[Any, argparse.Namespace], dict[str, Any]]],
    model_flops: Callable[[Any], int],
) -> None:
    """Prints the JSON line of ``script``: in a worker process (``--worker``)
    its measurement, with ``--threads`` threads; otherwise the report of
    :func:`run_rounds` over the workers it starts."""
    if args.worker is not None:
        import torch

        torch.set_num_threads(args.threads)

        print(json.dumps(workers[args.worker](cfg, args)))

        return

    print(json.dumps(run_rounds(script, args, cfg, variants, model_flops(cfg))))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    add_step_options(parser)
    add_run_options(parser, SHAPES)
    parser.add_argument("--worker", choices=list(_WORKERS), help=argparse.SUPPRESS)

    return parser


def main() -> None:
    parser = build_parser()

    args = parser.parse_args()

    variants = check_run_options(parser, args)

    cfg = SHAPES[args.shape]

    if args.seq_len is not None:
        cfg = replace(cfg, seq_len=args.seq_len)

    run_benchmark(__file__, args, variants, cfg, _WORKERS, model_flops)


if __name__ == "__main__":
    main()
