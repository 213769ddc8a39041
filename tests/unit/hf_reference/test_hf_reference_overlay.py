from __future__ import annotations

from pathlib import Path

import pytest

from hf_reference import (
    ACCELERATE_REFERENCE_VERSION,
    HF_REFERENCE_DIR_ENV,
    HF_REFERENCE_VERSION,
    PEFT_REFERENCE_VERSION,
    HfReferenceUnavailableError,
    ensure_hf_reference,
    hf_reference_available,
    hf_reference_dir,
)


class TestOverlay:
    def test_hf_reference_dir_follows_the_env_var(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(HF_REFERENCE_DIR_ENV, str(tmp_path / "overlay"))

        assert hf_reference_dir() == tmp_path / "overlay"

    def test_hf_reference_dir_defaults_to_the_repo_cache(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(HF_REFERENCE_DIR_ENV, raising=False)

        overlay_dir = hf_reference_dir()

        assert overlay_dir.parts[-2:] == (".cache", "hf-reference")
        assert (overlay_dir.parent.parent / "pyproject.toml").is_file()

    def test_hf_reference_available_is_false_without_qwen35(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        (tmp_path / "transformers" / "models" / "qwen3").mkdir(parents=True)

        monkeypatch.setenv(HF_REFERENCE_DIR_ENV, str(tmp_path))

        assert not hf_reference_available()

    def test_hf_reference_available_is_false_without_peft(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        for family in ("qwen3_5", "qwen3_5_moe"):
            (tmp_path / "transformers" / "models" / family).mkdir(parents=True)

        monkeypatch.setenv(HF_REFERENCE_DIR_ENV, str(tmp_path))

        assert not hf_reference_available()

        (tmp_path / "peft").mkdir()

        assert hf_reference_available()

    @pytest.mark.skipif(not hf_reference_available(), reason="the transformers 5.x overlay is not installed (`make setup`)")
    def test_overlay_holds_the_pinned_versions_and_no_torch_of_its_own(self) -> None:
        overlay_dir = hf_reference_dir()

        for name, version in (
            ("transformers", HF_REFERENCE_VERSION),
            ("peft", PEFT_REFERENCE_VERSION),
            ("accelerate", ACCELERATE_REFERENCE_VERSION),
        ):
            assert (overlay_dir / f"{name}-{version}.dist-info").is_dir(), name

        # PEFT depends on torch; a torch in the overlay would shadow the venv's.
        assert not list(overlay_dir.glob("torch*"))

    def test_ensure_hf_reference_raises_error_instead_of_overwriting_a_foreign_dir(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        (tmp_path / "something_else.txt").write_text("not an overlay")

        monkeypatch.setenv(HF_REFERENCE_DIR_ENV, str(tmp_path))

        with pytest.raises(HfReferenceUnavailableError, match="make setup"):
            ensure_hf_reference()

        assert [p.name for p in tmp_path.iterdir()] == ["something_else.txt"]
