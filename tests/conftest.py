"""Test-session setup shared by every test."""

from __future__ import annotations

import os

# A failing registration must fail the tests, not become a warning.
os.environ.setdefault("FAIRSEQ2_EXTENSION_TRACE", "1")
