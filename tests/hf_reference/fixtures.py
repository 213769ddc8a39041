"""The fixtures of the reference harness: tiny reference checkpoints shared
between the tests of one pytest session, and the reference subprocess's end
after each module.

Building a checkpoint costs a batch of the reference subprocess, so each
spec is built once per session. To use the fixtures, import them into a
``conftest.py``::

    from hf_reference.fixtures import hf_tiny_models as hf_tiny_models
    from hf_reference.fixtures import one_hf_reference_subprocess_a_module as one_hf_reference_subprocess_a_module
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import final

import pytest

from .runner import HfReferenceBatch, end_hf_reference_subprocess
from .spec import TinyQwen35Spec


@final
class TinyModelCache:
    """Builds tiny reference checkpoints on first request and keeps them, keyed by spec."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._model_dirs: dict[TinyQwen35Spec, Path] = {}

    def get(self, spec: TinyQwen35Spec) -> Path:
        """Returns the checkpoint directory of ``spec``, building it if needed."""
        return self.get_many([spec])[0]

    def get_many(self, specs: Sequence[TinyQwen35Spec]) -> list[Path]:
        """Returns the checkpoint directories of ``specs``, building the missing ones in one subprocess."""
        batch = HfReferenceBatch()

        built: dict[TinyQwen35Spec, Path] = {}

        for spec in specs:
            if spec not in self._model_dirs and spec not in built:
                built[spec] = batch.make_tiny_model(self._root / _dir_name(spec), spec)

        batch.run()

        self._model_dirs.update(built)

        return [self._model_dirs[spec] for spec in specs]


def _dir_name(spec: TinyQwen35Spec) -> str:
    digest = hashlib.sha256(json.dumps(spec.to_json(), sort_keys=True).encode()).hexdigest()

    return f"{spec.layout}-{'moe' if spec.moe else 'dense'}-{digest[:12]}"


@pytest.fixture(scope="session")
def hf_tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModelCache:
    """The session's cache of tiny reference checkpoints."""
    return TinyModelCache(tmp_path_factory.mktemp("hf_tiny_models"))


@pytest.fixture(scope="module", autouse=True)
def one_hf_reference_subprocess_a_module() -> Iterator[None]:
    """Ends the test process's reference subprocess after each module: the
    batches of a module share it, and the modules after it, some of which run
    alone for their memory, do not find most of a GiB held by it."""
    yield

    end_hf_reference_subprocess()
