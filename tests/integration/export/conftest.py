from __future__ import annotations

from pathlib import Path

import pytest

from export_testing import ALL_SPECS
from hf_reference import TinyQwen35Spec
from hf_reference.fixtures import TinyModelCache


@pytest.fixture(scope="session")
def base_dirs(hf_tiny_models: TinyModelCache) -> dict[TinyQwen35Spec, Path]:
    """The tiny reference checkpoints of the export tests, built by
    transformers 5.24 in one subprocess."""
    return dict(zip(ALL_SPECS, hf_tiny_models.get_many(ALL_SPECS), strict=True))
