"""Choosing and dispatching to the kernels of the Gated DeltaNet layers."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable, Iterator

import pytest
import torch
from fairseq2.error import NotSupportedError
from fairseq2.nn import BatchLayout

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

    def test_raises_error_when_fla_is_asked_on_cpu(self, fla_present: None, monkeypatch: pytest.MonkeyPatch) -> None:
        # Outside Triton's interpreter, which the test session turns on
        # without a GPU.
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)

        with pytest.raises(NotSupportedError, match="needs a CUDA device, but the device is 'cpu' instead"):
            resolve_gdn_backend("fla", CPU)

    def test_raises_error_when_fla_is_asked_but_missing(self, fla_missing: None) -> None:
        with pytest.raises(NotSupportedError, match=r"cannot be used: `fla` cannot be imported: it is not installed \(`pip install qwen35-fs2\[fast\]` installs fla-core>=0.6.0\)\."):
            resolve_gdn_backend("fla", CUDA)

    def test_raises_error_when_fla_is_too_old(self, monkeypatch: pytest.MonkeyPatch) -> None:
        backend_module.fla_unavailable_reason.cache_clear()

        fake_fla = types.ModuleType("fla")
        fake_fla.__version__ = "0.4.1"  # type: ignore[attr-defined]

        def import_module(name: str) -> object:
            return fake_fla

        monkeypatch.setattr(backend_module, "importlib", types.SimpleNamespace(import_module=import_module))

        try:
            with pytest.raises(NotSupportedError, match=r"cannot be used: it needs fla-core>=0.6.0, but fla-core 0.4.1 is installed"):
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


@pytest.fixture
def fake_fla_version(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """Makes ``import fla`` return a module of the given version."""

    def set_version(version: str) -> None:
        backend_module.fla_unavailable_reason.cache_clear()

        fake_fla = types.ModuleType("fla")
        fake_fla.__version__ = version  # type: ignore[attr-defined]

        monkeypatch.setattr(backend_module, "importlib", types.SimpleNamespace(import_module=lambda name: fake_fla))

    yield set_version

    backend_module.fla_unavailable_reason.cache_clear()


class TestFlaDetection:
    @pytest.mark.parametrize("version", ["0.6.0", "0.6.0rc1", "0.6.1.dev0", "1.0.0"])
    def test_accepts_0_6_0_and_later_including_pre_releases(
        self, fake_fla_version: Callable[[str], None], version: str
    ) -> None:
        fake_fla_version(version)

        assert backend_module.fla_unavailable_reason() is None

    @pytest.mark.parametrize("version", ["0.5.9", "0.4.1"])
    def test_rejects_older_versions(self, fake_fla_version: Callable[[str], None], version: str) -> None:
        fake_fla_version(version)

        assert backend_module.fla_unavailable_reason() == (
            f"it needs fla-core>=0.6.0, but fla-core {version} is installed (`pip install qwen35-fs2[fast]`)"
        )

    def test_rejects_an_unreadable_version(self, fake_fla_version: Callable[[str], None]) -> None:
        fake_fla_version("not-a-version")

        assert backend_module.fla_unavailable_reason() == "fla-core reports an unreadable version 'not-a-version'"

    def test_logs_why_an_installed_fla_fails_to_import(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        def import_module(name: str) -> object:
            raise ImportError("libcuda.so.1: cannot open shared object file")

        backend_module.fla_unavailable_reason.cache_clear()

        monkeypatch.setattr(backend_module, "importlib", types.SimpleNamespace(import_module=import_module))

        try:
            with caplog.at_level(logging.WARNING):
                reason = backend_module.fla_unavailable_reason()
        finally:
            backend_module.fla_unavailable_reason.cache_clear()

        assert reason == "`fla` cannot be imported (ImportError: libcuda.so.1: cannot open shared object file)"

        assert any("libcuda.so.1" in r.getMessage() for r in caplog.records)


class TestHopperWithOldTriton:
    """fla-core 0.6.0 refuses the gated delta rule's backward on Hopper GPUs
    with Triton 3.4.0 to 3.7.0 (fla issue #640); our PyTorch version of the
    kernel concerned takes over (``tests/unit/ops/test_fla_hopper.py``),
    unless fla's dispatch is off."""

    def test_auto_picks_fla_with_ours_taking_over(
        self, hopper_with_triton_3_6: None, caplog: pytest.LogCaptureFixture
    ) -> None:
        with caplog.at_level(logging.WARNING):
            assert resolve_gdn_backend("auto", CUDA) == "fla"

        assert not caplog.records

    def test_without_fla_dispatch_auto_picks_torch_with_one_warning(
        self, hopper_with_triton_3_6: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        monkeypatch.setenv("FLA_DISABLE_BACKEND_DISPATCH", "1")

        with caplog.at_level(logging.WARNING):
            assert resolve_gdn_backend("auto", CUDA) == "torch"
            assert resolve_gdn_backend("auto", CUDA) == "torch"

        warnings = [r.getMessage() for r in caplog.records if "fall back to their PyTorch kernels" in r.getMessage()]

        assert len(warnings) == 1

        assert "fla issue #640" in warnings[0]

    def test_without_fla_dispatch_fla_raises_error_naming_the_remedies(
        self, hopper_with_triton_3_6: None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import triton

        monkeypatch.setenv("FLA_DISABLE_BACKEND_DISPATCH", "1")

        with pytest.raises(NotSupportedError) as error:
            resolve_gdn_backend("fla", CUDA)

        message = str(error.value)

        assert message.startswith(
            f"The 'fla' Gated DeltaNet backend cannot be used: fla-core refuses to train on Hopper GPUs with Triton {triton.__version__}"
        )

        assert "unset it, or install Triton>=3.7.1 or TileLang (`pip install tilelang`)." in message


class TestHasCausalConv1d:
    @pytest.fixture(autouse=True)
    def clear_cache(self) -> Iterator[None]:
        backend_module.has_causal_conv1d.cache_clear()

        yield

        backend_module.has_causal_conv1d.cache_clear()

    def test_is_false_without_a_warning_when_not_installed(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        monkeypatch.setitem(sys.modules, "causal_conv1d", None)

        with caplog.at_level(logging.WARNING):
            assert not backend_module.has_causal_conv1d()

        assert not caplog.records

    def test_logs_why_an_installed_package_fails_to_import(
        self, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        def import_module(name: str) -> object:
            raise ImportError("causal_conv1d_cuda.so: undefined symbol: _ZN3c10")

        monkeypatch.setattr(backend_module, "importlib", types.SimpleNamespace(import_module=import_module))

        with caplog.at_level(logging.WARNING):
            assert not backend_module.has_causal_conv1d()

        messages = [r.getMessage() for r in caplog.records]

        assert any("causal-conv1d is installed but cannot be imported" in m and "undefined symbol" in m for m in messages)


class TestBackendFollowsTheDevice:
    def test_fla_on_cpu_is_accepted_only_under_triton_interpreter(
        self, fla_present: None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")

        assert resolve_gdn_backend("fla", CPU) == "fla"

        # `auto` never picks the interpreter.
        assert resolve_gdn_backend("auto", CPU) == "torch"

        monkeypatch.delenv("TRITON_INTERPRET")

        with pytest.raises(NotSupportedError, match="needs a CUDA device, but the device is 'cpu' instead"):
            resolve_gdn_backend("fla", CPU)

    def test_layer_resolves_for_the_device_of_each_input(
        self, fla_present: None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from qwen35_fs2.nn import gated_deltanet as gdn_module
        from qwen35_fs2.nn.gated_deltanet import GatedDeltaNet

        layer = GatedDeltaNet(16, 1, 2, 8, 8, 4, backend="auto")

        resolved = []

        def recording_resolve(requested: str, device: torch.device) -> str:
            result = resolve_gdn_backend(requested, device)  # type: ignore[arg-type]

            resolved.append((requested, device.type, result))

            return result

        monkeypatch.setattr(gdn_module, "resolve_gdn_backend", recording_resolve)

        x = torch.randn(1, 5, 16)

        layer(x, BatchLayout.of(x))

        # The layer and its convolution, for the CPU input of this call.
        assert resolved == [("auto", "cpu", "torch")] * 2

    def test_layer_asked_for_fla_fails_on_cpu_before_reaching_triton(
        self, fla_present: None, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from qwen35_fs2.nn.gated_deltanet import GatedDeltaNet

        monkeypatch.delenv("TRITON_INTERPRET", raising=False)

        layer = GatedDeltaNet(16, 1, 2, 8, 8, 4, backend="fla")

        x = torch.randn(1, 5, 16)

        with pytest.raises(NotSupportedError, match="needs a CUDA device, but the device is 'cpu' instead"):
            layer(x, BatchLayout.of(x))
