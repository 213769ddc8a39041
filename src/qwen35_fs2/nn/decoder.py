"""The decoder stack of Qwen3.5: the place where the per-batch metadata of
the hybrid layers and the recorder of the MoE routing statistics of a
forward pass are made, and where the statistics are collected."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

from torch import Tensor
from torch.nn import Module, ModuleList
from typing_extensions import override

from fairseq2.models.transformer_lm import TransformerLMDecoder
from fairseq2.nn import BatchLayout, IncrementalStateBag, LayerNorm

from qwen35_fs2.compat.attention_mask import make_attention_bias_cache
from qwen35_fs2.nn.decoder_layer import Qwen35DecoderLayer
from qwen35_fs2.nn.moe.block import Qwen35MoeBlock
from qwen35_fs2.nn.moe.statistics import MoeStatistics, MoeStatisticsRecorder
from qwen35_fs2.ops.varlen import VarlenMetadata


@final
class Qwen35Decoder(TransformerLMDecoder):
    """A stack of :class:`Qwen35DecoderLayer` and a final layer norm.

    Differences from fairseq2's ``StandardTransformerLMDecoder``: for a
    packed batch it makes the documents' :class:`VarlenMetadata` once per
    forward pass, from the host data of the batch layout, and hands it to
    every layer, so that no Gated DeltaNet layer reads offsets back from the
    device or rebuilds the kernels' index tensors. It makes the attention
    mask of a packed or padded batch before its layers run
    (:func:`~qwen35_fs2.compat.attention_mask.make_attention_bias_cache`),
    and the :class:`MoeStatisticsRecorder` of each forward pass, which
    records the routing statistics its layers return, and keeps it until
    :func:`collect_moe_statistics` takes it. A layer hook that returns
    ``False`` ends the stack after its layer, as
    :class:`~fairseq2.models.transformer_lm.TransformerLMDecoderLayerHook`
    documents.
    """

    layer_norm: LayerNorm

    def __init__(self, layers: Sequence[Qwen35DecoderLayer], layer_norm: LayerNorm) -> None:
        super().__init__()

        self.layers = ModuleList(layers)

        self.layer_norm = layer_norm

        self._moe_statistics: MoeStatisticsRecorder | None = None

    @override
    def forward(
        self,
        seqs: Tensor,
        seqs_layout: BatchLayout,
        *,
        state_bag: IncrementalStateBag | None = None,
    ) -> Tensor:
        attn_bias_cache = make_attention_bias_cache(
            self.layers, seqs, seqs_layout, incremental=state_bag is not None
        )

        varlen = None

        if seqs_layout.packed:
            varlen = VarlenMetadata.from_batch_layout(seqs_layout, seqs.device)

        # Replaces the recorder of the previous pass, if it was not collected.
        moe_statistics = self._moe_statistics = MoeStatisticsRecorder()

        num_layers = len(self.layers)

        for layer_idx, layer in enumerate(self.layers):
            seqs, routing = layer(
                seqs,
                seqs_layout,
                attn_bias_cache,
                state_bag=state_bag,
                varlen=varlen,
                return_moe_statistics=True,
            )

            if routing is not None:
                moe_statistics.record(_moe_block_of(layer), routing)

            hooks = self._layer_hooks.values()

            if not all(hook(layer_idx, seqs, seqs_layout, num_layers) for hook in hooks):
                break

        moe_statistics.close()

        return self.layer_norm(seqs)  # type: ignore[no-any-return]

    def take_moe_statistics(self) -> MoeStatisticsRecorder | None:
        """Returns the recorder of the last forward pass and forgets it, or
        ``None`` if there was no forward pass since the last call."""
        moe_statistics, self._moe_statistics = self._moe_statistics, None

        return moe_statistics

    @override
    def compile_layerwise(self, *args: Any, **kwargs: Any) -> None:
        for layer in self.layers:
            layer.compile(*args, **kwargs)

        self.layer_norm.compile(*args, **kwargs)


def _moe_block_of(layer: Module) -> Qwen35MoeBlock:
    """The MoE block of ``layer``, through activation-checkpoint and
    ``torch.compile`` wrappers."""
    for module in layer.modules():
        if isinstance(module, Qwen35MoeBlock):
            return module

    raise ValueError("`layer` must have an MoE block, but has none.")


def collect_moe_statistics(model: Module) -> MoeStatistics | None:
    """Combines the statistics that the MoE blocks of ``model`` recorded in
    its last forward pass, and makes its decoder forget them, with their
    autograd graph.

    Works through activation-checkpoint, FSDP, DDP, and ``torch.compile``
    wrappers. Call it after every forward pass whose load-balancing loss
    counts (every gradient-accumulation step), before the backward pass.
    Until then, or until its next forward pass, the decoder holds them.

    :returns: ``None`` if ``model`` has no MoE layers.

    :raises RuntimeError: if an MoE layer has no statistics, that is, no
        forward pass ran since the last call.
    """
    blocks = [m for m in model.modules() if isinstance(m, Qwen35MoeBlock)]

    if not blocks:
        return None

    decoders = [m for m in model.modules() if isinstance(m, Qwen35Decoder)]

    if len(decoders) != 1:
        raise ValueError(
            f"`model` must have one `Qwen35Decoder` to collect the statistics of its MoE layers, but has {len(decoders)} instead."
        )

    # Those of the decoder: an MTP head's MoE block (``model.mtp``) records
    # none.
    blocks = [m for m in decoders[0].modules() if isinstance(m, Qwen35MoeBlock)]

    moe_statistics = decoders[0].take_moe_statistics()

    # An empty recorder reports every layer as without statistics.
    if moe_statistics is None:
        moe_statistics = MoeStatisticsRecorder()

    return moe_statistics.collect(blocks)
