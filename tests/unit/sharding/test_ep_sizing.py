"""The expert-parallel sizing of ``docs/sharding.md`` (``scripts/ep_sizing.py``):
its parameter counts against our models built on the meta device, the doc's
tables against the script's output, and the arithmetic against numbers
worked out by hand."""

from __future__ import annotations

import importlib.util
import re
import sys
from collections import defaultdict
from pathlib import Path
from types import ModuleType

import pytest
from tp_testing import create_on_meta, fake_tp_gangs

REPO = Path(__file__).resolve().parents[3]


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ep_sizing", REPO / "scripts" / "ep_sizing.py")

    assert spec is not None and spec.loader is not None

    module = importlib.util.module_from_spec(spec)

    # Dataclasses look their module up by name.
    sys.modules["ep_sizing"] = module

    spec.loader.exec_module(module)

    return module


ep_sizing = _load_script()

_LAYER = re.compile(r"^(decoder|mtp)\.layers\.(\d+)\.")


@pytest.mark.parametrize(
    ("arch", "mtp_layers"),
    [
        ("qwen35_moe_35b_a3b", 1),
        ("qwen35_moe_35b_a3b", 0),
        ("qwen35_moe_122b_a10b", 1),
        ("qwen35_moe_397b_a17b", 1),
    ],
)
def test_parameter_counts_are_those_of_the_model(arch: str, mtp_layers: int) -> None:
    config = ep_sizing.sizing_config(arch, mtp_layers)

    model = create_on_meta(config, fake_tp_gangs(1))

    root = 0

    # Per layer, trunk then MTP: its parameters without the routed experts,
    # and the routed experts.
    layers: dict[tuple[int, int], int] = defaultdict(int)
    experts: dict[tuple[int, int], int] = defaultdict(int)

    for name, param in model.named_parameters():
        match = _LAYER.match(name)

        if match is None:
            root += param.numel()

            continue

        key = (0 if match[1] == "decoder" else 1, int(match[2]))

        if ".experts." in name:
            experts[key] += param.numel()
        else:
            layers[key] += param.numel()

    counts = ep_sizing.count_parameters(config)

    assert counts.root == root

    assert counts.layers == tuple(layers[key] for key in sorted(layers))

    assert len(layers) == config.num_layers + mtp_layers

    assert set(experts.values()) == {counts.experts_per_layer}

    assert counts.experts == sum(experts.values())

    assert counts.total == sum(p.numel() for p in model.parameters())


def test_the_doc_shows_the_script_output() -> None:
    doc = (REPO / "docs" / "sharding.md").read_text()

    assert ep_sizing.render_tables() in doc


def test_the_worked_example_of_the_doc() -> None:
    """35B-A3B on 16 GPUs, ep 8, 16,384 tokens per GPU, as the doc works it
    out by hand."""
    config = ep_sizing.sizing_config("qwen35_moe_35b_a3b")

    memory = ep_sizing.memory_per_gpu(config, 16, 8, 16_384)

    # 16 bytes x 35,505,251,456 parameters / 16.
    assert memory.state == 35_505_251_456

    # bf16 root (1,025,515,520), bf16 gradients of all but the embedding
    # (248,320 x 2,048).
    assert memory.root == 2 * 1_025_515_520 + 2 * (1_025_515_520 - 508_559_360)

    # 4 n + 8 x: n = 37,394,624 (a Gated DeltaNet layer), x = 32 experts of
    # 3 x 2,048 x 512.
    assert memory.layers == 4 * 37_394_624 + 8 * 32 * 3 * 2048 * 512

    # (40 x 4,096 + 283,264 + 212,544 + 12,288) bytes per token, and the
    # loss chunk 1,024 x 248,320 x 6.
    assert memory.activations == 16_384 * (163_840 + 283_264 + 212_544 + 12_288) + 1024 * 248_320 * 6

    traffic = ep_sizing.bytes_sent_per_gpu(config, 16, 8, 16_384)

    # 7/8 of 16,384 x 8 rows of 2,048 bf16 values, 6 x 40 + 4 times.
    assert traffic.all_to_all == pytest.approx(7 / 8 * 16_384 * 8 * 2048 * 2 * 244)

    # Root (2 + 4 bytes), the layers' rest (2 x 2 + 4 bytes, the MTP layer
    # 2 + 4) over 16 GPUs; the experts over 2.
    rest = 30 * 37_394_624 + 11 * 30_939_648

    fsdp = 15 / 16 * (6 * 1_025_515_520 + 8 * rest - 2 * 30_939_648) + 1 / 2 * 100_663_296 * (8 * 41 - 2)

    assert traffic.fsdp == pytest.approx(fsdp)

    assert ep_sizing.crossover_tokens(config) == pytest.approx(3 * 256 * 512 * 326 / (2 * 8 * 244))


@pytest.mark.parametrize("arch", ep_sizing.ARCHS)
def test_arithmetic_identities(arch: str) -> None:
    config = ep_sizing.sizing_config(arch)

    counts = ep_sizing.count_parameters(config)

    num_experts = config.experts.num_experts

    threshold = ep_sizing.crossover_tokens(config)

    for num_gpus in ep_sizing.NUM_GPUS:
        fsdp_only = ep_sizing.bytes_sent_per_gpu(config, num_gpus, 1, 8192)

        assert fsdp_only.all_to_all == 0

        # At ep = D an EP rank gathers E / D experts, from itself alone:
        # only the root and the layers' rest are sent, the layers twice
        # gathered (2 x 2 bytes) and once reduced (4) but the last, once
        # gathered.
        full = ep_sizing.bytes_sent_per_gpu(config, num_gpus, num_gpus, 8192)

        expert_size = 3 * config.model_dim * config.experts.inner_dim

        assert ep_sizing.gathered_experts(counts, num_gpus) == num_experts // num_gpus * expert_size

        last = len(counts.layers) - 1

        rest = 6 * counts.root + sum((6 if idx == last else 8) * size for idx, size in enumerate(counts.layers))

        assert full.fsdp == pytest.approx((num_gpus - 1) / num_gpus * rest)

        for ep in (2, 4, 8):
            # EP saves (ep - 1) / ep of the experts' FSDP traffic, whatever D.
            saved = fsdp_only.fsdp - ep_sizing.bytes_sent_per_gpu(config, num_gpus, ep, 8192).fsdp

            assert saved == pytest.approx((ep - 1) / ep * counts.experts_per_layer * (8 * len(counts.layers) - 2))

            # At the crossover EP and FSDP-only send the same bytes.
            ep_at = ep_sizing.bytes_sent_per_gpu(config, num_gpus, ep, threshold)
            fsdp_at = ep_sizing.bytes_sent_per_gpu(config, num_gpus, 1, threshold)

            assert ep_at.total == pytest.approx(fsdp_at.total)

        n = max(counts.layers)

        for ep in ep_sizing.EP_SIZES:
            x = ep_sizing.gathered_experts(counts, ep)

            assert x * ep == counts.experts_per_layer

            for tokens in ep_sizing.TOKENS_PER_GPU:
                memory = ep_sizing.memory_per_gpu(config, num_gpus, ep, tokens)

                # The state does not depend on ep; the gathered experts do.
                assert memory.state == 16 * counts.total / num_gpus

                # As the doc says: 10 u at ep = 1, and at ep > 1 the experts'
                # backward (4 n + 8 x) is the peak, not the rest's (10 n).
                assert memory.layers == (10 * (n + x) if ep == 1 else 4 * n + 8 * x)

                # The layers' backward is the step's peak, not the root's
                # reduce-scatter at its end.
                assert memory.peak == memory.state + memory.root + memory.layers + memory.activations


@pytest.mark.parametrize(("num_gpus", "ep"), [(24, 3), (8, 16), (16, 0)])
def test_ep_that_does_not_divide_is_an_error(num_gpus: int, ep: int) -> None:
    config = ep_sizing.sizing_config("qwen35_moe_35b_a3b")

    message = f"`ep` must divide the number of GPUs ({num_gpus}) and of experts (256), but is {ep} instead."

    with pytest.raises(ValueError, match=re.escape(message)):
        ep_sizing.memory_per_gpu(config, num_gpus, ep, 8192)
