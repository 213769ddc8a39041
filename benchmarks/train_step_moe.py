"""Measures a training step (forward + backward) of a qwen35-fs2 MoE model
against transformers' ``Qwen3_5MoeForCausalLM``, in the same run, and the
config's matmul floor.

The MoE counterpart of ``train_step.py``, whose timing and memory helpers it
uses. Each variant runs in a fresh subprocess (so peak memory is per variant):

- ``ours``: our model built by fairseq2 (``Qwen35MoeConfig``), its step
  including the load-balancing loss the recipes add;
- ``reference``: transformers' ``Qwen3_5MoeForCausalLM`` from the isolated
  overlay (``QWEN35_HF_REFERENCE_DIR``), ``output_router_logits=True`` so its
  loss includes the same aux term, fla and causal-conv1d hidden so it runs
  its PyTorch fallbacks on CPU;
- ``floor``: only the step's GEMMs (forward and backward) on random tensors:
  every dense projection, the LM head, and the routed experts as if
  perfectly balanced (one GEMM of ``tokens × top_k`` rows per projection).

Each variant runs ``--rounds`` times, interleaved with the others, and the
fastest step of all its rounds counts: on a shared machine the load changes
between variants, and the best step is the least disturbed one. Wall time
(``tokens_per_s``, ``speedup_vs_reference``) and CPU time of all threads
(``cpu_step_s``, ``cpu_speedup_vs_reference``) are reported; the latter
suffers less from other processes.

Prints one JSON line. Example::

    .venv/bin/python benchmarks/train_step_moe.py --threads 2 --rounds 3

With ``--profile N``, as in ``train_step.py``, the report lists the N
operators with the most self CPU time in one extra profiled step.

The options for GPUs are those of ``train_step.py`` (``--device cuda``,
``--dtype bf16``, ``--backend fla``, ``--compile``, ``--variants``), with
``--shape 35b-a3b-4k``: Qwen3.5-35B-A3B's layers (the smallest released MoE
model), 4 of its 40 so that one GPU holds the fp32 weights and gradients, on
one sequence of 4,096 tokens.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from typing import Any, Final, TypeAlias

# The measurement code is shared with the dense benchmark.
from train_step import (
    add_run_options,
    add_step_options,
    full_attention_flops,
    check_run_options,
    is_full_attention_layer,
    max_rss_mib,
    measure,
    prepare_model,
    run_benchmark,
    start_cuda_stats,
    step_context,
    synchronizer,
    time_steps_with_cpu,
    worker_device,
)

# The values of `qwen35_fs2.nn.moe.experts.ExpertDispatch`; this module imports
# neither fairseq2 nor our package at the top, as the reference worker runs
# transformers 5.x.
EXPERT_DISPATCHES = ("auto", "grouped_mm", "batched", "loop")

AUX_LOSS_COEF = 0.001

WorkerResult: TypeAlias = dict[str, Any]
"""What a worker prints as JSON: its step ``times`` and, by worker, its
memory (``baseline_rss_mib``, ``peak_rss_mib``) or ``flops``."""


@dataclass(kw_only=True)
class MoeBenchConfig:
    """The MoE reference configuration of issue #5; the rest as the dense
    benchmark's."""

    model_dim: int = 512
    num_layers: int = 8
    full_attention_interval: int = 4
    num_attn_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 64
    num_linear_key_heads: int = 4
    num_linear_value_heads: int = 8
    linear_head_dim: int = 64
    num_experts: int = 32
    top_k: int = 4
    expert_inner_dim: int = 256
    shared_expert_inner_dim: int = 256
    vocab_size: int = 4096
    batch_size: int = 2
    seq_len: int = 1024
    expert_dispatch: str = "auto"


SHAPES: Final = {
    "reference": MoeBenchConfig(),
    # Qwen3.5-35B-A3B (the `qwen35_moe_35b_a3b` architecture) with 4 of its
    # 40 layers (3 Gated DeltaNet, 1 attention) on one sequence of 4,096
    # tokens: 4.4B parameters, whose fp32 weights and gradients take 35 GB.
    "35b-a3b-4k": MoeBenchConfig(
        model_dim=2048,
        num_layers=4,
        num_attn_heads=16,
        head_dim=256,
        num_linear_key_heads=16,
        num_linear_value_heads=32,
        linear_head_dim=128,
        num_experts=256,
        top_k=8,
        expert_inner_dim=512,
        shared_expert_inner_dim=512,
        vocab_size=248_320,
        batch_size=1,
        seq_len=4096,
    ),
}
"""The shapes of ``--shape``."""


def ours_config(cfg: MoeBenchConfig, backend: str = "torch") -> Any:
    """Returns the ``Qwen35MoeConfig`` of ``cfg`` with the Gated DeltaNet
    kernels of ``backend``."""
    from qwen35_fs2.models.qwen35_moe import Qwen35ExpertsConfig, Qwen35MoeConfig

    return Qwen35MoeConfig(
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
        experts=Qwen35ExpertsConfig(
            num_experts=cfg.num_experts,
            top_k=cfg.top_k,
            inner_dim=cfg.expert_inner_dim,
            shared_expert_inner_dim=cfg.shared_expert_inner_dim,
            dispatch=cfg.expert_dispatch,  # type: ignore[arg-type]
        ),
        gdn_backend=backend,  # type: ignore[arg-type]
    )


def _run_ours(cfg: MoeBenchConfig, args: argparse.Namespace) -> WorkerResult:
    import torch

    from fairseq2.nn import BatchLayout

    from qwen35_fs2.nn import collect_moe_statistics
    from qwen35_fs2.models.qwen35_moe import create_qwen35_moe_model
    from qwen35_fs2.recipes.loss import install_chunked_lm_loss

    config = ours_config(cfg, args.backend)

    device = worker_device(args)

    torch.manual_seed(0)

    # On the device, as fairseq2 creates models.
    with device:
        model = create_qwen35_moe_model(config)

    # The loss the recipes train with.
    model = prepare_model(install_chunked_lm_loss(model).train(), args, device)

    seqs = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), device=device)

    inputs, targets = seqs[:, :-1], seqs[:, 1:]

    layout = BatchLayout.of(inputs)

    baseline_rss = max_rss_mib()

    def step() -> None:
        # The recipes add the load-balancing loss under autocast too.
        with step_context(args, device):
            loss = model(inputs, layout, targets, reduction="mean")

            moe_statistics = collect_moe_statistics(model)

            assert moe_statistics is not None

            loss = loss + AUX_LOSS_COEF * moe_statistics.load_balancing_loss

        torch.autograd.backward(loss)

        model.zero_grad(set_to_none=True)

    return measure(step, args, device, baseline_rss)


def _run_reference(cfg: MoeBenchConfig, args: argparse.Namespace) -> WorkerResult:
    # transformers calls fla / causal_conv1d whenever importable; they fail on
    # CPU.
    for name in ("fla", "causal_conv1d"):
        sys.modules[name] = None  # type: ignore[assignment]

    import torch
    # From the transformers 5.x overlay on this worker's `PYTHONPATH`.
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # type: ignore[attr-defined]

    config = Qwen3_5MoeTextConfig(
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
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        moe_intermediate_size=cfg.expert_inner_dim,
        shared_expert_intermediate_size=cfg.shared_expert_inner_dim,
        router_aux_loss_coef=AUX_LOSS_COEF,
        max_position_embeddings=cfg.seq_len + 1,
        tie_word_embeddings=False,
    )

    torch.manual_seed(0)

    model = Qwen3_5MoeForCausalLM(config).train()

    input_ids = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len))

    device = torch.device("cpu")

    baseline_rss = max_rss_mib()

    def step() -> None:
        with step_context(args, device):
            output = model(input_ids=input_ids, labels=input_ids, use_cache=False, output_router_logits=True)

        torch.autograd.backward(output.loss)

        model.zero_grad(set_to_none=True)

    return measure(step, args, device, baseline_rss)


def gemm_shapes(cfg: MoeBenchConfig) -> list[tuple[int, int, int]]:
    """Returns ``(num_rows, input_dim, output_dim)`` of every GEMM of the
    forward pass, with ``num_tokens`` rows but for the routed experts."""
    num_tokens = cfg.batch_size * cfg.seq_len

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

    dense_moe = [
        (d, cfg.num_experts),  # router
        (d, 2 * cfg.shared_expert_inner_dim),  # shared expert gate and up
        (cfg.shared_expert_inner_dim, d),
        (d, 1),  # shared expert gate
    ]

    routed = [
        (num_tokens * cfg.top_k, d, 2 * cfg.expert_inner_dim),
        (num_tokens * cfg.top_k, cfg.expert_inner_dim, d),
    ]

    shapes: list[tuple[int, int, int]] = []

    for idx in range(cfg.num_layers):
        full = is_full_attention_layer(cfg, idx)

        shapes.extend((num_tokens, i, o) for i, o in (attn if full else gdn) + dense_moe)

        shapes.extend(routed)

    shapes.append((num_tokens, d, cfg.vocab_size))

    return shapes


def gemm_flops(cfg: MoeBenchConfig) -> int:
    """Returns the FLOPs of the GEMMs of :func:`gemm_shapes`, forward and
    backward (three products of ``2 * rows * input_dim * output_dim``)."""
    return sum(6 * num_rows * input_dim * output_dim for num_rows, input_dim, output_dim in gemm_shapes(cfg))


def model_flops(cfg: MoeBenchConfig) -> int:
    """Returns the FLOPs of a training step that MFU counts: the GEMMs (the
    routed experts' of the ``top_k`` experts of every token) and the causal
    attention of the full-attention layers; as ``train_step.model_flops``."""
    return gemm_flops(cfg) + full_attention_flops(cfg)


def _run_floor(cfg: MoeBenchConfig, args: argparse.Namespace) -> WorkerResult:
    import torch

    device = worker_device(args)

    # The dtype autocast runs the GEMMs in.
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    torch.manual_seed(0)

    operands = []

    for num_rows, input_dim, output_dim in gemm_shapes(cfg):
        x = torch.randn(num_rows, input_dim, device=device, dtype=dtype)
        w = torch.randn(output_dim, input_dim, device=device, dtype=dtype)
        dy = torch.randn(num_rows, output_dim, device=device, dtype=dtype)

        operands.append((x, w, dy))

    def step() -> None:
        for x, w, dy in operands:
            x @ w.t()  # forward
            dy @ w  # input gradient
            dy.t() @ x  # weight gradient

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    add_step_options(parser)
    parser.add_argument("--expert-dispatch", choices=EXPERT_DISPATCHES, default="auto")
    add_run_options(parser, SHAPES)
    parser.add_argument("--worker", choices=list(_WORKERS), help=argparse.SUPPRESS)

    return parser


def main() -> None:
    parser = build_parser()

    args = parser.parse_args()

    variants = check_run_options(parser, args)

    cfg = replace(SHAPES[args.shape], expert_dispatch=args.expert_dispatch)

    if args.seq_len is not None:
        cfg = replace(cfg, seq_len=args.seq_len)

    run_benchmark(__file__, args, variants, cfg, _WORKERS, model_flops)


if __name__ == "__main__":
    main()
