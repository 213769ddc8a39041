"""The ``fairseq2`` command (alias ``qwen35-fs2``): ``fairseq2 lm <recipe>``
runs our recipes (:mod:`qwen35_fs2.cli.main`), ``fairseq2 lm export_hf``
exports a checkpoint to Hugging Face (:mod:`qwen35_fs2.cli.export_hf`)."""
