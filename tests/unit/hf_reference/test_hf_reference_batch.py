from __future__ import annotations

import pytest
import torch

from hf_reference import HfReferenceBatch, Pending


class TestHfReferenceBatch:
    def test_result_raises_error_before_the_batch_runs(self) -> None:
        pending: Pending[torch.Tensor] = HfReferenceBatch().logits("unused", [[1, 2]])

        with pytest.raises(RuntimeError, match="has not run yet"):
            pending.result()

    def test_logits_raises_error_when_input_ids_are_ragged(self) -> None:
        with pytest.raises(ValueError, match=r"rectangular batch of token ids of shape \[N, S\]"):
            HfReferenceBatch().logits("unused", [[1, 2], [3]])

    def test_logits_raises_error_when_input_ids_are_not_two_dimensional(self) -> None:
        with pytest.raises(ValueError, match="non-empty batch of non-empty rows"):
            HfReferenceBatch().logits("unused", torch.zeros(1, 2, 3, dtype=torch.int64))

    def test_logits_raises_error_when_the_mask_shape_differs(self) -> None:
        with pytest.raises(ValueError, match=r"`attention_mask` must have the shape of `input_ids` \(1, 2\)"):
            HfReferenceBatch().logits("unused", [[1, 2]], attention_mask=[[1, 1, 0]])

    def test_greedy_generate_accepts_prompts_of_different_lengths(self) -> None:
        batch = HfReferenceBatch()

        pending = batch.greedy_generate("unused", [[1, 2], [3]], max_new_tokens=2)

        # The worker gets each prompt as given, neither padded nor cut, and
        # decodes them one at a time (tested on a real model in
        # test_hf_reference_models.py).
        assert [request["prompts"] for request in batch._requests] == [[[1, 2], [3]]]

        with pytest.raises(RuntimeError, match="has not run yet"):
            pending.result()

    def test_greedy_generate_raises_error_when_a_prompt_is_empty(self) -> None:
        with pytest.raises(ValueError, match="non-empty rows"):
            HfReferenceBatch().greedy_generate("unused", [[1, 2], []], max_new_tokens=2)
