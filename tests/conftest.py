"""Test-session setup shared by every test."""

from __future__ import annotations

import os

# A failing registration must fail the tests, not become a warning.
os.environ.setdefault("FAIRSEQ2_EXTENSION_TRACE", "1")

from hf_reference.fixtures import hf_tiny_models as hf_tiny_models  # noqa: E402
