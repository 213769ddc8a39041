"""Our fairseq2 recipes for Qwen3.5: ``lm instruction_finetune``, ``lm
train``, ``lm generate`` and ``lm eval_gsm8k`` (see :mod:`qwen35_fs2.cli`)."""
