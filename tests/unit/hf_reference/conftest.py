from __future__ import annotations

from hf_reference.fixtures import hf_tiny_models as hf_tiny_models
