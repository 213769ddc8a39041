"""Workaround: a model family decides how the checkpoint directory it was
asked to load is loaded (fairseq2 0.8.1).

Sharded loading (:mod:`qwen35_fs2.hf.sharded_loading`) needs the Qwen3.5
families to return the model of a Hugging Face checkpoint on the meta device
and to know the checkpoint's directory, whether a recipe names the checkpoint
by an asset card (``ModelFamily.load_model``) or by a path
(``ModelFamily.load_custom_model``). fairseq2 0.8.1 has no public hook for
it: ``register_model_family`` builds a ``StandardModelFamily`` (marked
``@final``), whose public ``load_model`` turns a card into a directory with
private code (``_download_model``, the card's ``checkpoint``,
``checkpoint_path`` and ``restrict`` fields, legacy ``shard_idx`` paths, and
its errors for each), and then both public methods hand the directory to the
private ``_do_load_model``. A family that implemented ``ModelFamily`` itself,
or overrode the public ``load_model``, would copy that private code and drift
from fairseq2's silently; a custom ``ModelCheckpointLoader`` only supplies
the tensors that rank 0 loads and broadcasts. Overriding ``_do_load_model``
alone relies on one private method, which
``tests/unit/compat/test_checkpoint_loading_hook.py`` pins: it fails if
either public method stops reaching it with the resolved directory, or if its
signature changes.

:class:`CheckpointLoadingHookFamily` is fairseq2's family with that step
public, as :meth:`~CheckpointLoadingHookFamily.load_checkpoint`. It can go
once fairseq2 lets a family take over loading a resolved checkpoint through
a public method (or ``register_model_family`` takes a loader): the families
then override that instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import final

from torch.nn import Module
from typing_extensions import override

from fairseq2.data_type import DataType
from fairseq2.gang import Gangs
from fairseq2.models.family import StandardModelFamily


@final
@dataclass(frozen=True)
class CheckpointLoadRequest:
    """What a family is asked to load: the arguments of
    ``ModelFamily.load_custom_model``, or of ``load_model`` with the
    directory and ``restrict`` of the asset card resolved."""

    path: Path

    config: object

    gangs: Gangs

    dtype: DataType

    load_rank0_only: bool

    mmap: bool

    restrict: bool | None


class CheckpointLoadingHookFamily(StandardModelFamily):  # type: ignore[misc]
    """fairseq2's ``StandardModelFamily``, whose loading of a checkpoint
    directory, after ``load_model`` resolved it from an asset card or as
    ``load_custom_model`` received it, is :meth:`load_checkpoint`."""

    def load_checkpoint(self, request: CheckpointLoadRequest) -> Module:
        """Loads the checkpoint of ``request`` as fairseq2 does (on
        data-parallel rank 0, broadcast to the others unless
        ``load_rank0_only``). Subclasses override it; ``load_model`` maps
        the errors it raises to errors of the asset card, as for fairseq2's
        loading."""
        model: Module = super()._do_load_model(
            request.path, request.config, request.gangs, request.dtype, request.load_rank0_only, request.mmap, request.restrict
        )

        return model

    @override
    def _do_load_model(
        self,
        path: Path,
        config: object,
        gangs: Gangs,
        dtype: DataType,
        load_rank0_only: bool,
        mmap: bool,
        restrict: bool | None,
    ) -> Module:
        return self.load_checkpoint(CheckpointLoadRequest(path, config, gangs, dtype, load_rank0_only, mmap, restrict))
