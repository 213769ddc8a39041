"""The Qwen3.5 model families, one folder each, as fairseq2 keeps its own
(``fairseq2.models.qwen``): its configuration and architecture presets,
factory, hub accessor, Hugging Face key map and shard specs.

- :mod:`qwen35_fs2.models.qwen35`: dense Qwen3.5 (``qwen35``), and the
  ``qwen35`` tokenizer family;
- :mod:`qwen35_fs2.models.qwen35_moe`: Qwen3.5-MoE (``qwen35_moe``);
- :mod:`qwen35_fs2.models.qwen3_next`: importing Qwen3-Next checkpoints into
  ``qwen35_moe``;
- :mod:`qwen35_fs2.models.family`: the fairseq2 model family both register.

The families assemble the layers of :mod:`qwen35_fs2.nn`.
"""
