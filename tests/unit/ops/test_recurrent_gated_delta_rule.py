"""The token-by-token gated delta rule: the reference of every other path,
checked against the plain matrix recurrence and against transformers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

from hf_reference.overlay import hf_reference_available, hf_reference_dir
from qwen35_fs2.ops import chunk_gated_delta_rule, gated_rms_norm, recurrent_gated_delta_rule

from .helpers import DeltaRuleInputs, assert_close, cu_seqlens_of, make_delta_rule_inputs


def matrix_recurrence(inputs: DeltaRuleInputs, initial_state: Tensor) -> tuple[Tensor, Tensor]:
    """``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``
    and ``o_t = S_t^T q_t / sqrt(K)``, head by head, in fp64."""
    q, k, v, g, beta = (t.double() for t in inputs.tensors())

    batch_size, seq_len, num_heads, key_dim = q.shape

    num_v_heads = v.size(2)

    o = torch.zeros_like(v)

    states = initial_state.double().clone()

    eye = torch.eye(key_dim, dtype=torch.float64)

    for b in range(batch_size):
        for h in range(num_v_heads):
            qk_head = h // (num_v_heads // num_heads)

            state = states[b, h]

            for t in range(seq_len):
                q_t = q[b, t, qk_head] / q[b, t, qk_head].pow(2).sum().add(1e-6).sqrt()
                k_t = k[b, t, qk_head] / k[b, t, qk_head].pow(2).sum().add(1e-6).sqrt()

                transition = g[b, t, h].exp() * (eye - beta[b, t, h] * torch.outer(k_t, k_t))

                state = transition @ state + beta[b, t, h] * torch.outer(k_t, v[b, t, h])

                o[b, t, h] = state.T @ q_t * key_dim**-0.5

            states[b, h] = state

    return o, states


class TestRecurrentGatedDeltaRule:
    def test_matches_the_matrix_recurrence(self) -> None:
        inputs = make_delta_rule_inputs(2, 7, 2, 4, 3, 5, dtype=torch.float64)

        h0 = torch.randn(2, 4, 3, 5, dtype=torch.float64)

        expected_o, expected_ht = matrix_recurrence(inputs, h0)

        o, ht = recurrent_gated_delta_rule(*inputs.tensors(), initial_state=h0, output_final_state=True)

        assert_close("o", expected_o, o, 1e-12)
        assert_close("ht", expected_ht, ht, 1e-12)

    def test_decoding_one_token_at_a_time_matches_one_pass(self) -> None:
        inputs = make_delta_rule_inputs(3, 20, 1, 2, 8, 8)

        expected_o, expected_ht = recurrent_gated_delta_rule(*inputs.tensors(), output_final_state=True)

        state, outputs = None, []

        for t in range(20):
            o, state = recurrent_gated_delta_rule(
                *(x[:, t : t + 1] for x in inputs.tensors()), initial_state=state, output_final_state=True
            )

            outputs.append(o)

        assert state is not None

        assert_close("o", expected_o, torch.cat(outputs, dim=1), 1e-6)
        assert_close("ht", expected_ht, state, 1e-6)

    def test_packed_documents_match_separate_runs(self) -> None:
        lengths = [5, 1, 0, 9]

        inputs = make_delta_rule_inputs(1, 15, 2, 2, 4, 4)

        h0 = torch.randn(4, 2, 4, 4)

        o, ht = recurrent_gated_delta_rule(
            *inputs.tensors(), initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens_of(lengths)
        )

        assert ht is not None

        begin = 0

        for idx, length in enumerate(lengths):
            doc = (t[:, begin : begin + length] for t in inputs.tensors())

            doc_o, doc_ht = recurrent_gated_delta_rule(
                *doc, initial_state=h0[idx : idx + 1], output_final_state=True
            )

            assert_close(f"o of document {idx}", doc_o, o[:, begin : begin + length], 1e-7)
            assert_close(f"ht of document {idx}", doc_ht, ht[idx : idx + 1], 1e-7)

            begin += length

    @pytest.mark.slow
    @pytest.mark.skipif(not hf_reference_available(), reason="the transformers 5.x overlay is not installed (`make setup`)")
    def test_matches_transformers_reference(self, tmp_path: Path) -> None:
        # Strong decay, grouped value heads, T not a multiple of 64.
        inputs = make_delta_rule_inputs(2, 150, 2, 4, 16, 16, max_decay=16.0, seed=21)

        gen = torch.Generator().manual_seed(22)

        h0 = torch.randn(2, 4, 16, 16, generator=gen)

        x = torch.randn(2, 150, 4, 16, generator=gen)
        gate = torch.randn(2, 150, 4, 16, generator=gen)
        weight = torch.rand(16, generator=gen) + 0.5

        torch.save(
            {"inputs": inputs.tensors(), "h0": h0, "x": x, "gate": gate, "weight": weight},
            tmp_path / "inputs.pt",
        )

        expected = _run_transformers(tmp_path)

        o, ht = recurrent_gated_delta_rule(*inputs.tensors(), initial_state=h0, output_final_state=True)

        assert_close("recurrent o", expected["recurrent_o"], o, 1e-5)
        assert_close("recurrent ht", expected["recurrent_ht"], ht, 1e-5)

        o, ht = chunk_gated_delta_rule(*inputs.tensors(), initial_state=h0, output_final_state=True)

        assert_close("chunk o", expected["chunk_o"], o, 1e-5)
        assert_close("chunk ht", expected["chunk_ht"], ht, 1e-5)

        for dtype in (torch.float32, torch.bfloat16):
            y = gated_rms_norm(x.to(dtype), gate.to(dtype), weight, 1e-6)

            # The same operations in the same order: equal up to the last bit
            # of fp32 rounding.
            assert_close(f"gated norm {dtype}", expected[f"norm_{dtype}"], y, 1e-6)

            assert y.dtype == dtype


_TRANSFORMERS_SCRIPT = """
import sys

# transformers calls fla / causal_conv1d whenever importable; they fail on CPU.
sys.modules["fla"] = None
sys.modules["causal_conv1d"] = None

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as m

data = torch.load(sys.argv[1] + "/inputs.pt")

q, k, v, g, beta = data["inputs"]

out = {}

out["recurrent_o"], out["recurrent_ht"] = m.torch_recurrent_gated_delta_rule(
    q, k, v, g=g, beta=beta, initial_state=data["h0"].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
)
out["chunk_o"], out["chunk_ht"] = m.torch_chunk_gated_delta_rule(
    q, k, v, g=g, beta=beta, initial_state=data["h0"].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
)

for dtype in (torch.float32, torch.bfloat16):
    norm = m.Qwen3_5RMSNormGated(16, eps=1e-6)
    norm.weight.data.copy_(data["weight"])
    with torch.no_grad():
        out[f"norm_{dtype}"] = norm(data["x"].to(dtype), data["gate"].to(dtype))

torch.save(out, sys.argv[1] + "/outputs.pt")
"""


def _run_transformers(tmp_path: Path) -> dict[str, Tensor]:
    env = {**os.environ, "PYTHONPATH": str(hf_reference_dir())}

    result = subprocess.run(
        [sys.executable, "-c", _TRANSFORMERS_SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True
    )

    assert result.returncode == 0, result.stderr

    return torch.load(tmp_path / "outputs.pt")  # type: ignore[no-any-return]
