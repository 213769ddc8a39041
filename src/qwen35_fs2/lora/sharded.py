"""Reading the adapters of a LoRA checkpoint under any tensor parallel size."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor
from torch.nn import Module

from fairseq2.gang import Gangs
from fairseq2.model_checkpoint import ModelCheckpointLoadOptions, get_model_checkpoint_loader
from fairseq2.nn import get_shard_dims


def read_lora_checkpoint(path: Path, model: Module, gangs: Gangs, *, mmap: bool = False) -> dict[str, Tensor]:
    """Returns the tensors of the fairseq2 checkpoint at ``path`` (the
    adapters that a LoRA run saves) as the rank of ``gangs.tp`` holds them in
    ``model``, whatever the tensor parallel size they were saved under.

    The checkpoint is resharded by the shard dims of ``model``, whose
    adapters report theirs (:class:`~qwen35_fs2.nn.lora.LoraAdapter`). A
    family's ``iter_checkpoint`` takes the shard dims of a model it creates,
    which has no adapters: it would treat them as replicated and return the
    first rank's shards of a tensor-parallel run's ``B`` (or ``A``) alone.
    """
    options = ModelCheckpointLoadOptions(gangs=gangs, mmap=mmap)

    return dict(get_model_checkpoint_loader().lazy_load(path, get_shard_dims(model), options))
