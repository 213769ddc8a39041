"""The decoder stack of Qwen3.5: the place where the per-batch metadata of
the hybrid layers is made."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

from torch import Tensor
from torch.nn import ModuleList
from typing_extensions import override

from fairseq2.models.transformer import AttentionBiasCache
from fairseq2.models.transformer_lm import TransformerLMDecoder
from fairseq2.nn import BatchLayout, IncrementalStateBag, LayerNorm

from qwen35_fs2.nn.decoder_layer import Qwen35DecoderLayer
from qwen35_fs2.ops.varlen import VarlenMetadata


@final
class Qwen35Decoder(TransformerLMDecoder):
    """A stack of :class:`Qwen35DecoderLayer` and a final layer norm.

    Differences from fairseq2's ``StandardTransformerLMDecoder``: for a
    packed batch it makes the documents' :class:`VarlenMetadata` once per
    forward pass, from the host data of the batch layout, and hands it to
    every layer, so that no Gated DeltaNet layer reads offsets back from the
    device or rebuilds the kernels' index tensors. A layer hook that returns
    ``False`` ends the stack after its layer, as
    :class:`~fairseq2.models.transformer_lm.TransformerLMDecoderLayerHook`
    documents.
    """

    layer_norm: LayerNorm

    def __init__(self, layers: Sequence[Qwen35DecoderLayer], layer_norm: LayerNorm) -> None:
        super().__init__()

        self.layers = ModuleList(layers)

        self.layer_norm = layer_norm

    @override
    def forward(
        self,
        seqs: Tensor,
        seqs_layout: BatchLayout,
        *,
        state_bag: IncrementalStateBag | None = None,
    ) -> Tensor:
        attn_bias_cache = AttentionBiasCache()

        varlen = None

        if seqs_layout.packed:
            varlen = VarlenMetadata.from_batch_layout(seqs_layout, seqs.device)

        num_layers = len(self.layers)

        for layer_idx, layer in enumerate(self.layers):
            seqs = layer(seqs, seqs_layout, attn_bias_cache, state_bag=state_bag, varlen=varlen)

            hooks = self._layer_hooks.values()

            if not all(hook(layer_idx, seqs, seqs_layout, num_layers) for hook in hooks):
                break

        return self.layer_norm(seqs)  # type: ignore[no-any-return]

    @override
    def compile_layerwise(self, *args: Any, **kwargs: Any) -> None:
        for layer in self.layers:
            layer.compile(*args, **kwargs)

        self.layer_norm.compile(*args, **kwargs)
