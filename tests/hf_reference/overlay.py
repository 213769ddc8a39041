"""Locates, and installs on demand, the transformers 5.x overlay.

transformers >= 5.2 holds the Qwen3.5 reference, but fairseq2 pins
transformers ~= 4.57, so the reference is installed with ``pip --target`` into
a directory of its own and only ever put on ``PYTHONPATH`` of a subprocess.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Final

HF_REFERENCE_VERSION: Final = "5.24.0"

HF_REFERENCE_DIR_ENV: Final = "QWEN35_HF_REFERENCE_DIR"

_REPO_ROOT: Final = Path(__file__).resolve().parents[2]

# Written by the Makefile's rule for the overlay too, which then skips it.
_INSTALLED_MARKER: Final = ".installed"


class HfReferenceUnavailableError(RuntimeError):
    """Raised when the transformers overlay is missing and cannot be installed."""


def hf_reference_dir() -> Path:
    """Returns ``$QWEN35_HF_REFERENCE_DIR``, or ``<repo>/.cache/hf-reference``."""
    path = os.environ.get(HF_REFERENCE_DIR_ENV)
    if path:
        return Path(path).resolve()

    return _REPO_ROOT / ".cache" / "hf-reference"


def hf_reference_available() -> bool:
    """Returns ``True`` if the overlay holds transformers with Qwen3.5 (dense and MoE)."""
    models_dir = hf_reference_dir() / "transformers" / "models"

    return (models_dir / "qwen3_5").is_dir() and (models_dir / "qwen3_5_moe").is_dir()


def _install_instructions(overlay_dir: Path) -> str:
    return (
        f"Run `make setup`, or `{sys.executable} -m pip install --target {overlay_dir} "
        f"transformers=={HF_REFERENCE_VERSION}`, or point ${HF_REFERENCE_DIR_ENV} at such a directory."
    )


def ensure_hf_reference() -> Path:
    """Returns the overlay directory, installing transformers into it first if it is missing.

    The install goes to a temporary sibling that is renamed into place, so an
    interrupted or concurrent install never leaves a half-filled overlay.

    :raises HfReferenceUnavailableError: if the overlay cannot be installed.
    """
    overlay_dir = hf_reference_dir()

    if hf_reference_available():
        return overlay_dir

    if overlay_dir.exists() and any(overlay_dir.iterdir()):
        raise HfReferenceUnavailableError(
            f"{overlay_dir} exists but holds no transformers with Qwen3.5, and is not overwritten. "
            f"Remove it, then: {_install_instructions(overlay_dir)}"
        )

    overlay_dir.parent.mkdir(parents=True, exist_ok=True)

    staging_dir = Path(tempfile.mkdtemp(prefix=f".{overlay_dir.name}-", dir=overlay_dir.parent))

    try:
        command = [
            sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
            "--target", str(staging_dir), f"transformers=={HF_REFERENCE_VERSION}",
        ]  # fmt: skip

        process = subprocess.run(command, capture_output=True, text=True)
        if process.returncode != 0:
            raise HfReferenceUnavailableError(
                f"Installing the transformers {HF_REFERENCE_VERSION} overlay into {overlay_dir} failed "
                f"(pip exited with {process.returncode}). {_install_instructions(overlay_dir)}\n"
                f"pip stderr:\n{process.stderr}"
            )

        (staging_dir / _INSTALLED_MARKER).touch()

        try:
            if overlay_dir.exists():
                overlay_dir.rmdir()  # Empty, checked above.

            staging_dir.rename(overlay_dir)
        except OSError:
            # Another process installed it first.
            if not hf_reference_available():
                raise
    finally:
        shutil.rmtree(staging_dir, ignore_errors=True)

    return overlay_dir
