from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fairseq2.assets import get_asset_store
from fairseq2.models.hub import load_model  # noqa: F401  (the API users call)

from offline_hub import use_offline_hub_cache
from qwen35_fs2.models.qwen35 import get_qwen35_model_hub

_RELEASED = ["0.8b", "2b", "4b", "9b", "27b"]


class TestRegistration:
    @pytest.mark.parametrize("size", _RELEASED)
    def test_released_models_have_cards_for_the_family_and_their_arch(self, size: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        # Without a config.json of the checkpoint, the card's config is its
        # arch's.
        use_offline_hub_cache(monkeypatch, tmp_path)

        hub = get_qwen35_model_hub()

        names = [f"qwen35_{size}"] + ([] if size == "27b" else [f"qwen35_{size}_base"])

        for name in names:
            card = get_asset_store().retrieve_card(name)

            assert card.field("model_family").as_(str) == "qwen35"
            assert card.field("tokenizer_family").as_(str) == "qwen35"

            suffix = "-Base" if name.endswith("_base") else ""

            assert card.field("checkpoint").as_(str) == f"hg://Qwen/Qwen3.5-{size.upper()}{suffix}"

            # The card's config is the arch's.
            assert hub.get_model_config(card) == hub.get_arch_config(f"qwen35_{size}")

    @pytest.mark.slow
    def test_offline_tokenizer_card_loads_the_real_vocabulary(self, tmp_path: Path) -> None:
        # A fresh process with an empty cache: the card's loader builds the
        # vocabulary on first use. fairseq2 loads the extension there without
        # importing `fairseq2.recipe` (the trainer, wandb, torcheval), which
        # only recipes need: 10 s of every such process on the test machines'
        # slow hours.
        script = textwrap.dedent(
            """\
            import sys
            from fairseq2.data.tokenizers import load_tokenizer
            info = load_tokenizer("qwen35_tokenizer").vocab_info
            print(info.eos_idx, info.pad_idx, "fairseq2.recipe" in sys.modules)
            """
        )

        env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), FAIRSEQ2_EXTENSION_TRACE="1")

        result = subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True)

        assert result.stdout.split() == ["248046", "248044", "False"]
