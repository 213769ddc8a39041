from __future__ import annotations

import pytest

from hf_reference import LayerTypeName, TinyQwen35Spec


class TestTinyQwen35Spec:
    def test_layer_types_follow_the_full_attention_interval(self) -> None:
        spec = TinyQwen35Spec(num_hidden_layers=8, full_attention_interval=4)

        linear, full = "linear_attention", "full_attention"

        assert spec.resolved_layer_types() == (linear, linear, linear, full, linear, linear, linear, full)

    def test_explicit_layer_types_override_the_interval(self) -> None:
        layer_types: tuple[LayerTypeName, ...] = ("full_attention", "linear_attention")

        spec = TinyQwen35Spec(num_hidden_layers=2, layer_types=layer_types, full_attention_interval=2)

        assert spec.resolved_layer_types() == layer_types

    def test_init_raises_error_when_layer_types_do_not_match_num_layers(self) -> None:
        with pytest.raises(ValueError, match=r"`layer_types` must have `num_hidden_layers` \(3\) entries"):
            TinyQwen35Spec(num_hidden_layers=3, layer_types=("full_attention",))

    def test_init_raises_error_when_value_heads_are_not_a_multiple_of_key_heads(self) -> None:
        with pytest.raises(ValueError, match="`linear_num_value_heads` must be a multiple"):
            TinyQwen35Spec(linear_num_key_heads=2, linear_num_value_heads=3)

    def test_equal_specs_are_equal_cache_keys(self) -> None:
        cache = {TinyQwen35Spec(moe=True, seed=3): "built"}

        assert cache.get(TinyQwen35Spec(moe=True, seed=3)) == "built"
        assert cache.get(TinyQwen35Spec(moe=True, seed=4)) is None
