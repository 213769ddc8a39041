"""The parameter counts that ``docs/sharding.md`` derives its memory numbers
from, counted on the meta device."""

from __future__ import annotations

import pytest
from tp_testing import create_on_meta, fake_tp_gangs

from fairseq2.models.transformer_lm import TransformerLM

from qwen35_fs2.models.qwen35 import get_qwen35_model_hub
from qwen35_fs2.models.qwen35_moe import get_qwen35_moe_model_hub


def _billions(count: int) -> float:
    return round(count / 1e9, 3)


@pytest.mark.parametrize(
    ("arch", "total", "embedding", "experts"),
    [("qwen35_27b", 26.896, 1.271, 0.0), ("qwen35_moe_35b_a3b", 34.661, 0.509, 32.212)],
)
def test_parameter_counts_are_those_of_the_docs(arch: str, total: float, embedding: float, experts: float) -> None:
    hub = get_qwen35_moe_model_hub() if "moe" in arch else get_qwen35_model_hub()

    model = create_on_meta(hub.get_arch_config(arch), fake_tp_gangs(1))

    assert isinstance(model, TransformerLM)

    params = dict(model.named_parameters())

    assert _billions(sum(p.numel() for p in params.values())) == total

    # Untied: the output projection is as large again.
    assert _billions(params["decoder_frontend.embed.weight"].numel()) == embedding
    assert _billions(params["final_proj.weight"].numel()) == embedding

    assert _billions(sum(p.numel() for name, p in params.items() if ".experts." in name)) == experts
