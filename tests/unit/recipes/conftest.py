from __future__ import annotations

import pytest

from qwen35_fs2.models.qwen35.tokenizer import (
    Qwen35Tokenizer,
    Qwen35TokenizerConfig,
    get_qwen35_tokenizer_dir,
    load_qwen35_tokenizer,
)


@pytest.fixture(scope="session")
def tokenizer() -> Qwen35Tokenizer:
    """The real Qwen3.5 vocabulary, for SFT: EOS `<|im_end|>`, pad
    `<|endoftext|>`."""
    return load_qwen35_tokenizer(get_qwen35_tokenizer_dir(), Qwen35TokenizerConfig())
