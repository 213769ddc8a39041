"""Exports Qwen3.5 models as Hugging Face repositories that transformers and
vLLM load in place of the released ones.

fairseq2's own exporter cannot do this: it instantiates the config class of
the installed transformers (4.57 has no Qwen3.5), fills every unset key with
that class's defaults, writes fp32 and drops every tensor it does not model
(the vision tower, the multi-token-prediction head). Here ``config.json`` is
written by this package with every key explicit, tensors keep the base
model's dtype, and what this package does not train is copied from the base
repository unchanged.

The state dicts are converted by renaming keys only: our zero-centred norms
store their weights as the checkpoints do (see
:class:`~qwen35_fs2.nn.normalization.ZeroCenteredRMSNorm`), so no tensor
is shifted by 1 on import or export, and a round trip is bitwise.

An export is planned (:mod:`~qwen35_fs2.hf.export.plan`, with its
``config.json`` from :mod:`~qwen35_fs2.hf.export.config` and its tensors
from :mod:`~qwen35_fs2.hf.export.tensors`), then written
(:mod:`~qwen35_fs2.hf.export.writer`); :mod:`~qwen35_fs2.hf.export.save`
does both for a model object, :mod:`~qwen35_fs2.hf.export.checkpoint` for a
training checkpoint.
"""

from __future__ import annotations

from qwen35_fs2.hf.export.config import build_hf_config as build_hf_config
from qwen35_fs2.hf.export.plan import HfExportPlan as HfExportPlan
from qwen35_fs2.hf.export.plan import plan_hf_export as plan_hf_export
from qwen35_fs2.hf.export.repository import EXPORT_DTYPES as EXPORT_DTYPES
from qwen35_fs2.hf.export.repository import HfExportError as HfExportError
from qwen35_fs2.hf.export.repository import HfRepository as HfRepository
from qwen35_fs2.hf.export.save import save_hf_model as save_hf_model
from qwen35_fs2.hf.export.tensors import lay_out_experts as lay_out_experts
from qwen35_fs2.hf.export.tensors import to_hg_state_dict as to_hg_state_dict
from qwen35_fs2.hf.export.writer import DEFAULT_MAX_SHARD_SIZE as DEFAULT_MAX_SHARD_SIZE
from qwen35_fs2.hf.export.writer import check_output_dir as check_output_dir
from qwen35_fs2.hf.export.writer import write_hf_export as write_hf_export
