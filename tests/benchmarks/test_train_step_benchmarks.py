"""The training-step benchmarks' options for GPUs (``--device``, ``--dtype``,
``--backend``, ``--compile``, ``--shape``, ``--variants``), their shapes,
FLOP counts and bf16 peaks, checked on CPU: the scripts run as users run
them, in subprocesses, at a few tokens. Their CUDA runs are ``make
gpu-check``'s (``scripts/gpu_check.py``)."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fairseq2.nn import Projection

from qwen35_fs2.models.qwen35 import create_qwen35_model, get_qwen35_model_hub
from qwen35_fs2.models.qwen35_moe import create_qwen35_moe_model, get_qwen35_moe_model_hub
from qwen35_fs2.nn.moe.experts import RoutedExperts
from qwen35_fs2.nn.moe.router import TopKRouter

from benchmark_runner import BENCHMARKS, read_report, run_benchmark_script

# `train_step_moe.py` imports `train_step` as its neighbour.
sys.path.insert(0, str(BENCHMARKS))

import train_step  # noqa: E402
import train_step_moe  # noqa: E402

# Settings of the benchmarks, not of the architectures.
_BENCHMARK_FIELDS = {"max_seq_len", "pad_idx", "gdn_backend"}


class TestCommandLine:
    @pytest.mark.slow
    def test_dense_run_reports_its_options_and_the_cpu_fields(self) -> None:
        report = read_report(
            run_benchmark_script("train_step.py", "--variants=floor,ours", "--dtype=bf16", "--seq-len=16", "--num-warmup=1", "--num-steps=1")
        )

        assert report["config"]["seq_len"] == 16

        options = {name: report[name] for name in ("device", "dtype", "backend", "compile", "shape")}

        assert options == {"device": "cpu", "dtype": "bf16", "backend": "torch", "compile": False, "shape": "reference"}

        # Only the variants asked for, and what compares them.
        assert "reference" not in report and "speedup_vs_reference" not in report

        assert report["ours_fraction_of_floor"] > 0 and report["ours_cpu_fraction_of_floor"] > 0

        # One round by default; the CPU comes with the numbers.
        assert report["rounds"] == 1 and report["cpu"]["model_name"]

        floor, ours = report["floor"], report["ours"]

        assert ours["median_step_s"] >= ours["step_s"] > 0 and ours["cpu_step_s"] > 0

        assert floor["gflop_per_s"] > 0 and floor["tokens_per_s"] > 0

        # 2 sequences of 16 tokens. `tokens_per_s` comes from the unrounded
        # step and is rounded to 0.1, `step_s` to 1e-4 s: the two agree to
        # 0.05 plus what the step's rounding moves 32 / step_s (0.4 tokens/s
        # for a 60 ms step, which a quiet machine reaches).
        step_s = ours["step_s"]

        assert ours["tokens_per_s"] == pytest.approx(32 / step_s, abs=0.05 + 32 * 0.5e-4 / (step_s * (step_s - 0.5e-4)))

        assert ours["peak_rss_mib"] >= ours["step_peak_above_init_mib"] >= 0

        assert len(ours["warmup_step_s"]) == 1

        # The fields of CUDA runs only come with them.
        assert "mfu" not in ours and "device_name" not in report

    @pytest.mark.slow
    def test_moe_run_reports_its_options_and_the_cpu_fields(self) -> None:
        report = read_report(
            run_benchmark_script("train_step_moe.py", "--variants=ours", "--seq-len=16", "--num-warmup=1", "--num-steps=1", "--profile=3")
        )

        assert (report["device"], report["dtype"], report["shape"]) == ("cpu", "fp32", "reference")

        assert set(report) & {"floor", "reference"} == set()

        ours = report["ours"]

        assert ours["cpu_step_s"] > 0 and ours["peak_rss_mib"] >= ours["step_peak_above_init_mib"] >= 0

        assert len(ours["warmup_step_s"]) == 1

        # `--profile=3`: the three operators with the most self CPU time.
        profile = ours["profile"]

        assert len(profile) == 3 and all(entry["op"] and entry["calls"] > 0 for entry in profile)

        assert [entry["self_ms"] for entry in profile] == sorted((entry["self_ms"] for entry in profile), reverse=True)

    @pytest.mark.parametrize("script", ["train_step.py", "train_step_moe.py"])
    @pytest.mark.parametrize(
        "options, message",
        [
            (["--backend=fla"], "`--backend fla` needs `--device cuda`"),
            (["--device=cuda"], "`--variants` must leave out `reference` with `--device cuda`"),
            (["--compile"], "`--variants` must leave out `reference` with `--compile`"),
            (["--variants=ours,fastest"], "`--variants` must list some of floor, ours, reference, but includes 'fastest' instead."),
            (["--device=cuda", "--variants=ours", "--profile=5"], "`--profile` lists self CPU time and needs `--device cpu`"),
        ],
    )
    def test_options_that_cannot_go_together_are_refused(self, script: str, options: list[str], message: str) -> None:
        result = run_benchmark_script(script, *options)

        assert result.returncode == 2

        assert message in result.stderr

    def test_cuda_without_a_device_fails_clearly(self) -> None:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")

        result = run_benchmark_script("train_step.py", "--device=cuda", "--dtype=bf16", "--variants=floor", "--seq-len=16", env=env)

        assert result.returncode != 0

        assert "error: the floor worker failed" in result.stderr

        assert "`--device cuda` needs a CUDA device, but torch" in result.stderr


class TestShapes:
    def test_0p8b_4k_is_the_released_0p8b_architecture_on_4096_tokens(self) -> None:
        cfg = train_step.SHAPES["0.8b-4k"]

        assert cfg.batch_size * cfg.seq_len == 4096

        expected = get_qwen35_model_hub().get_arch_config("qwen35_0.8b")

        config = train_step.ours_config(cfg)

        for field in dataclasses.fields(config):
            if field.name not in _BENCHMARK_FIELDS:
                assert getattr(config, field.name) == getattr(expected, field.name), field.name

    def test_35b_a3b_4k_is_the_released_35b_a3b_architecture_with_4_layers(self) -> None:
        cfg = train_step_moe.SHAPES["35b-a3b-4k"]

        assert cfg.batch_size * cfg.seq_len == 4096

        expected = get_qwen35_moe_model_hub().get_arch_config("qwen35_moe_35b_a3b")

        expected.num_layers = 4

        config = train_step_moe.ours_config(cfg)

        for field in dataclasses.fields(config):
            if field.name not in _BENCHMARK_FIELDS:
                assert getattr(config, field.name) == getattr(expected, field.name), field.name


class TestFlops:
    @pytest.mark.parametrize("shape", list(train_step.SHAPES))
    def test_dense_gemm_flops_are_those_of_the_model_projections(self, shape: str) -> None:
        cfg = train_step.SHAPES[shape]

        with torch.device("meta"):
            model = create_qwen35_model(train_step.ours_config(cfg))

        weights = sum(m.input_dim * m.output_dim for m in model.modules() if isinstance(m, Projection))

        assert train_step.gemm_flops(cfg) == 6 * cfg.batch_size * cfg.seq_len * weights

    @pytest.mark.parametrize("shape", list(train_step_moe.SHAPES))
    def test_moe_gemm_flops_are_those_of_the_model_with_top_k_experts_a_token(self, shape: str) -> None:
        cfg = train_step_moe.SHAPES[shape]

        with torch.device("meta"):
            model = create_qwen35_moe_model(train_step_moe.ours_config(cfg))

        # Every token goes through the dense projections and the router, and
        # through `top_k` experts, a `1 / num_experts` share of the weights.
        weights = 0

        for m in model.modules():
            if isinstance(m, Projection):
                weights += m.input_dim * m.output_dim
            elif isinstance(m, TopKRouter):
                weights += m.weight.numel()
            elif isinstance(m, RoutedExperts):
                weights += cfg.top_k * sum(p.numel() for p in m.parameters()) // cfg.num_experts

        assert train_step_moe.gemm_flops(cfg) == 6 * cfg.batch_size * cfg.seq_len * weights

    def test_causal_attention_flops_are_half_of_what_pytorch_counts_for_full_attention(self) -> None:
        batch_size, num_heads, seq_len, head_dim = 2, 3, 40, 8

        q, k, v = (torch.randn(batch_size, num_heads, seq_len, head_dim, requires_grad=True) for _ in range(3))

        mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()

        # The products of attention, whose FLOPs PyTorch's counter counts for
        # every query-key pair, masked or not (on CPU it counts none of SDPA's
        # kernel).
        with FlopCounterMode(display=False) as counter:
            scores = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf"))

            (scores.softmax(dim=-1) @ v).sum().backward()

        flops = train_step.causal_attention_flops(
            num_layers=1, num_heads=num_heads, head_dim=head_dim, batch_size=batch_size, seq_len=seq_len
        )

        assert 2 * flops == counter.get_total_flops()


class TestBf16Peak:
    @pytest.mark.parametrize(
        "device_name, tflops",
        [
            # `torch.cuda.get_device_name()` of each; the dense bf16 peaks of
            # NVIDIA's data sheets.
            ("NVIDIA H100 80GB HBM3", 989.5),
            ("NVIDIA H100 PCIe", 756.5),
            ("NVIDIA H100 NVL", 835.5),
            ("NVIDIA H200", 989.5),
            ("NVIDIA H200 NVL", 835.5),
            ("NVIDIA A100-SXM4-80GB", 312.0),
            ("NVIDIA A100 80GB PCIe", 312.0),
        ],
    )
    def test_known_gpus_have_their_data_sheet_peak(self, device_name: str, tflops: float) -> None:
        peak, source = train_step.bf16_peak_flops(device_name)

        assert peak == pytest.approx(tflops * 1e12)

        assert "data sheet" in source

    @pytest.mark.parametrize(
        "device_name, reason",
        [
            ("NVIDIA RTX A1000", "No bf16 peak is known for 'NVIDIA RTX A1000'"),
            ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "is a MIG slice"),
        ],
    )
    def test_other_gpus_have_no_peak_and_a_reason(self, device_name: str, reason: str) -> None:
        peak, why = train_step.bf16_peak_flops(device_name)

        assert peak is None

        assert reason in why

    def test_fp32_runs_have_no_mfu(self) -> None:
        peak, why = train_step.mfu_peak("NVIDIA H100 80GB HBM3", "fp32")

        assert peak is None

        assert why == "MFU is measured against the GPU's bf16 peak, but this run is fp32."
