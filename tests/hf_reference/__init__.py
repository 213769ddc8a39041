"""Runs the transformers Qwen3.5 reference, which our parity tests compare against.

transformers >= 5.2 conflicts with fairseq2's pins, so the reference lives in an
overlay directory and runs only in subprocesses; see :mod:`.overlay`.

Tests import it as ``hf_reference``: ``tests/`` has a ``conftest.py`` but no
``__init__.py``, so pytest puts ``tests/`` on ``sys.path``. The package imports
itself relatively, so it works as ``tests.hf_reference`` too.
"""

from __future__ import annotations

from .overlay import ACCELERATE_REFERENCE_VERSION as ACCELERATE_REFERENCE_VERSION
from .overlay import HF_REFERENCE_DIR_ENV as HF_REFERENCE_DIR_ENV
from .overlay import HF_REFERENCE_VERSION as HF_REFERENCE_VERSION
from .overlay import PEFT_REFERENCE_VERSION as PEFT_REFERENCE_VERSION
from .overlay import HfReferenceUnavailableError as HfReferenceUnavailableError
from .overlay import ensure_hf_reference as ensure_hf_reference
from .overlay import hf_reference_available as hf_reference_available
from .overlay import hf_reference_dir as hf_reference_dir
from .runner import HfReferenceBatch as HfReferenceBatch
from .runner import HfReferenceError as HfReferenceError
from .runner import end_hf_reference_subprocess as end_hf_reference_subprocess
from .runner import ModelClass as ModelClass
from .runner import Pending as Pending
from .runner import TokenIds as TokenIds
from .runner import hf_greedy_generate as hf_greedy_generate
from .runner import hf_logits as hf_logits
from .runner import make_tiny_hf_model as make_tiny_hf_model
from .spec import CheckpointLayout as CheckpointLayout
from .spec import ExpertLayout as ExpertLayout
from .spec import LayerTypeName as LayerTypeName
from .spec import ReferenceDtype as ReferenceDtype
from .spec import ReferencePrecision as ReferencePrecision
from .spec import TinyQwen35Spec as TinyQwen35Spec
from .spec import qwen35_0p8b_spec as qwen35_0p8b_spec
from .tensors import read_safetensors_dir as read_safetensors_dir
