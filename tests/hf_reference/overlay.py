"""Locates, and installs on demand, the transformers 5.x overlay.

transformers >= 5.2 holds the Qwen3.5 reference, but fairseq2 pins
transformers ~= 4.57, so the reference is installed with ``pip --target`` into
a directory of its own and only ever put on ``PYTHONPATH`` of a subprocess.
PEFT, the LoRA reference, and accelerate, which PEFT imports, live there too,
installed without their dependencies: ``pip --target`` would otherwise put a
second torch (with CUDA) into the overlay, shadowing the venv's. Their other
dependencies are transformers' or the venv's (torch, psutil).
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

PEFT_REFERENCE_VERSION: Final = "0.21.2"

ACCELERATE_REFERENCE_VERSION: Final = "1.15.0"

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
    """Returns ``True`` if the overlay holds transformers with Qwen3.5 (dense and MoE) and PEFT."""
    overlay_dir = hf_reference_dir()

    models_dir = overlay_dir / "transformers" / "models"

    return (
        (models_dir / "qwen3_5").is_dir()
        and (models_dir / "qwen3_5_moe").is_dir()
        and (overlay_dir / "peft").is_dir()
    )


def _install_commands(target_dir: Path) -> list[list[str]]:
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-warn-conflicts"]

    return [
        [*pip, "--target", str(target_dir), f"transformers=={HF_REFERENCE_VERSION}"],
        [*pip, "--no-deps", "--target", str(target_dir), f"peft=={PEFT_REFERENCE_VERSION}", f"accelerate=={ACCELERATE_REFERENCE_VERSION}"],
    ]  # fmt: skip


def _install_instructions(overlay_dir: Path) -> str:
    commands = " && ".join(" ".join(command) for command in _install_commands(overlay_dir))

    return f"Run `make setup`, or `{commands}`, or point ${HF_REFERENCE_DIR_ENV} at such a directory."


def ensure_hf_reference() -> Path:
    """Returns the overlay directory, installing transformers and PEFT into it first if it is missing.

    The install goes to a temporary sibling that is renamed into place, so an
    interrupted or concurrent install never leaves a half-filled overlay.

    :raises HfReferenceUnavailableError: if the overlay cannot be installed.
    """
    overlay_dir = hf_reference_dir()

    if hf_reference_available():
        return overlay_dir

    if overlay_dir.exists() and any(overlay_dir.iterdir()):
        raise HfReferenceUnavailableError(
            f"{overlay_dir} exists but holds no transformers with Qwen3.5 and PEFT, and is not overwritten. "
            f"Remove it, then: {_install_instructions(overlay_dir)}"
        )

    overlay_dir.parent.mkdir(parents=True, exist_ok=True)

    staging_dir = Path(tempfile.mkdtemp(prefix=f".{overlay_dir.name}-", dir=overlay_dir.parent))

    try:
        for command in _install_commands(staging_dir):
            process = subprocess.run(command, capture_output=True, text=True)
            if process.returncode != 0:
                raise HfReferenceUnavailableError(
                    f"Installing the transformers {HF_REFERENCE_VERSION} and PEFT {PEFT_REFERENCE_VERSION} overlay into {overlay_dir} failed "
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
