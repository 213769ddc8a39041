"""Choosing and dispatching to the kernels of the Gated DeltaNet layers."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator

import pytest
import torch
from fairseq2.error import NotSupportedError

import qwen35_fs2.ops.backend as backend_module
import qwen35_fs2.ops.delta_rule.dispatch as dispatch_module
from qwen35_fs2.ops import chunk_gated_delta_rule, gated_delta_rule, resolve_gdn_backend

from .helpers import assert_close, make_delta_rule_inputs

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


@pytest.fixture
def fla_missing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Makes ``import fla`` fail, as on a machine without fla-core."""
    backend_module.fla_unavailable_reason.cache_clear()
    backend_module._warn_fla_fallback.cache_clear()

    monkeypatch.setitem(sys.modules, "fla", None)

    yield

    backend_module.fla_unavailable_reason.cache_clear()
    backend_module._warn_fla_fallback.cache_clear()


@pytest.fixture
def fla_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend_module, "fla_unavailable_reason", lambda: None)


class TestResolveGdnBackend:
    def test_torch_is_used_as_asked(self, fla_present: None) -> None:
        assert resolve_gdn_backend("torch", CUDA) == "torch"

    def test_auto_picks_torch_on_cpu(self, fla_present: None) -> None:
        assert resolve_gdn_backend("auto", CPU) == "torch"

    def test_auto_picks_fla_on_cuda_when_fla_imports(self, fla_present: None) -> None:
        assert resolve_gdn_backend("auto", CUDA) == "fla"

    def test_auto_falls_back_to_torch_on_cuda_with_one_warning(
        self, fla_missing: None, caplog: pytest.LogCaptureFixture
    ) -> None:
        with caplog.at_level(logging.WARNING):
            assert resolve_gdn_backend("auto", CUDA) == "torch"
            assert resolve_gdn_backend("auto", CUDA) == "torch"

        warnings = [r for r in caplog.records if "fall back to their PyTorch kernels" in r.getMessage()]

        assert len(warnings) == 1

        assert "`fla` cannot be imported" in warnings[0].getMessage()

    def test_auto_falls_back_to_torch_on_cpu_silently(
        self, fla_missing: None, caplog: pytest.LogCaptureFixture
    ) -> None:
        with caplog.at_level(logging.WARNING):
            assert resolve_gdn_backend("auto", CPU) == "torch"

        assert not caplog.records

    def test_raises_error_when_fla_is_asked_on_cpu(self, fla_present: None) -> None:
        with pytest.raises(NotSupportedError, match="needs a CUDA device, but the device is 'cpu' instead"):
            resolve_gdn_backend("fla", CPU)

    def test_raises_error_when_fla_is_asked_but_missing(self, fla_missing: None) -> None:
        with pytest.raises(NotSupportedError, match=r"needs fla-core>=0.6.0 .* but `fla` cannot be imported"):
            resolve_gdn_backend("fla", CUDA)

    def test_raises_error_when_fla_is_too_old(self, monkeypatch: pytest.MonkeyPatch) -> None:
        backend_module.fla_unavailable_reason.cache_clear()

        fake_fla = types.ModuleType("fla")
        fake_fla.__version__ = "0.4.1"  # type: ignore[attr-defined]

        def import_module(name: str) -> object:
            return fake_fla

        monkeypatch.setattr(backend_module, "importlib", types.SimpleNamespace(import_module=import_module))

        try:
            with pytest.raises(NotSupportedError, match="fla-core 0.4.1 is installed"):
                resolve_gdn_backend("fla", CUDA)
        finally:
            backend_module.fla_unavailable_reason.cache_clear()

    def test_raises_error_when_request_is_unknown(self) -> None:
        with pytest.raises(ValueError, match="`requested` must be 'auto', 'torch', or 'fla', but is 'triton' instead"):
            resolve_gdn_backend("triton", CPU)  # type: ignore[arg-type]


class TestGatedDeltaRule:
    def test_torch_backend_runs_the_chunked_kernel(self) -> None:
        inputs = make_delta_rule_inputs(2, 70, 2, 4, 8, 8)

        h0 = torch.randn(2, 4, 8, 8)

        o, ht = gated_delta_rule(*inputs.tensors(), backend="torch", initial_state=h0, output_final_state=True)

        expected_o, expected_ht = chunk_gated_delta_rule(*inputs.tensors(), initial_state=h0, output_final_state=True)

        assert torch.equal(o, expected_o)
        assert torch.equal(ht, expected_ht)  # type: ignore[arg-type]

    def test_torch_backend_decodes_one_token_with_the_recurrent_step(self, monkeypatch: pytest.MonkeyPatch) -> None:
        inputs = make_delta_rule_inputs(2, 1, 2, 4, 8, 8)

        h0 = torch.randn(2, 4, 8, 8)

        expected_o, expected_ht = chunk_gated_delta_rule(*inputs.tensors(), initial_state=h0, output_final_state=True)

        def fail(*args: object, **kwargs: object) -> None:
            raise AssertionError("the chunked kernel must not decode")

        monkeypatch.setattr(dispatch_module, "chunk_gated_delta_rule", fail)

        o, ht = gated_delta_rule(*inputs.tensors(), backend="torch", initial_state=h0, output_final_state=True)

        assert_close("o", expected_o, o, 1e-6)
        assert_close("ht", expected_ht, ht, 1e-6)

    def test_raises_error_when_backend_is_unknown(self) -> None:
        inputs = make_delta_rule_inputs(1, 4, 1, 1, 4, 4)

        with pytest.raises(ValueError, match="`backend` must be 'torch' or 'fla', but is 'auto' instead"):
            gated_delta_rule(*inputs.tensors(), backend="auto")  # type: ignore[arg-type]

    def test_checks_shapes_before_dispatching(self) -> None:
        inputs = make_delta_rule_inputs(1, 4, 1, 1, 4, 4)

        with pytest.raises(ValueError, match="`initial_state` must be of shape"):
            gated_delta_rule(*inputs.tensors(), backend="fla", initial_state=torch.zeros(2, 1, 4, 4))
