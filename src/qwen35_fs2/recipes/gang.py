"""The ``gang`` section of the Qwen3.5 training recipes: fairseq2's, plus
expert parallelism."""

from __future__ import annotations

from dataclasses import dataclass

from fairseq2.recipe.config import GangSection
from fairseq2.utils.validation import ValidationResult


@dataclass(kw_only=True)
class Qwen35GangSection(GangSection):
    expert_parallel_size: int = 1
    """
    The number of consecutive data-parallel ranks that split the routed
    experts of every MoE layer among them and exchange tokens with all-to-all
    (:mod:`qwen35_fs2.parallel.expert_parallel`); 1 for none. It must divide
    the data-parallel size and the number of experts per tensor-parallel
    rank, and needs ``trainer.data_parallelism: fsdp``. Keep a group within
    a node (at most its GPUs).
    """

    def validate(self) -> ValidationResult:
        result = super().validate()

        if self.expert_parallel_size < 1:
            result.add_error(
                f"`expert_parallel_size` must be greater than or equal to 1, but is {self.expert_parallel_size} instead."
            )

        return result
