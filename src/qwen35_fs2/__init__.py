"""Qwen3.5 for fairseq2."""
