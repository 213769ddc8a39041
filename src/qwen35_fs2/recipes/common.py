"""Parts shared by the Qwen3.5 language-model recipes: the base of the
training recipes, the loss of a batch, the training and validation units,
vocabulary checks and metric names."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeAlias, cast, final

import torch
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from fairseq2.data.tokenizers import Tokenizer
from fairseq2.error import InternalError, NotSupportedError
from fairseq2.datasets import DataReader, SequenceBatch
from fairseq2.recipe.evaluator import EvalUnit
from fairseq2.logging import log
from fairseq2.metrics import Max, Mean, MetricBag, Min, Sum
from fairseq2.metrics.common import (
    add_nll_loss_metric,
    add_seq_batch_metrics,
    update_nll_loss_metric,
    update_seq_batch_metrics,
)
from fairseq2.metrics.formatters import format_as_float, format_as_int
from fairseq2.metrics.recorders import MetricDescriptor, MetricFormatter
from fairseq2.models.clm import CausalLM
from fairseq2.models.transformer_lm import TransformerLM
from fairseq2.nn.data_parallel import get_data_parallel_facade, set_data_parallel_facade
from fairseq2.recipe.config import ModelSection, TrainerSection
from fairseq2.recipe.base import Recipe, RecipeContext
from fairseq2.recipe.cli import register_cli_error
from fairseq2.recipe.error import RecipeError
from fairseq2.runtime.dependency import DependencyContainer
from fairseq2.recipe.trainer import TrainUnit
from fairseq2.task import Task
from fairseq2.utils.validation import ValidationResult

from qwen35_fs2.datasets.files import find_shared_files
from qwen35_fs2.recipes.loss import DEFAULT_LOSS_CHUNK_SIZE, MtpLossMode, install_chunked_lm_loss
from qwen35_fs2.nn.moe.statistics import MoeStatistics
from qwen35_fs2.nn.mtp import find_mtp
from qwen35_fs2.nn.decoder import collect_moe_statistics
from qwen35_fs2.nn.moe.block import Qwen35MoeBlock
from qwen35_fs2.hf.sharded_loading import (
    enable_sharded_checkpoint_loading,
    finish_sharded_checkpoint_loading,
)
from qwen35_fs2.compat.dynamo_graphs import compiled_graph_count, graph_break_reasons
from qwen35_fs2.compat.stop_on_signal import stop_file_from_env, stop_on_signal
from qwen35_fs2.recipes.hf_export import export_hf_checkpoints, take_over_hf_export
from qwen35_fs2.recipes.idle_batches import is_idle_batch
from qwen35_fs2.recipes.lora import save_adapters_only, setup_lora
from qwen35_fs2.recipes.resume import RestoredConfig, check_restored_config
from qwen35_fs2.lora import LoraConfig
from qwen35_fs2.parallel.expert_parallel import (
    ExpertParallelGroups,
    apply_expert_parallelism,
    create_expert_parallel_groups,
    keep_optimizer_state_on_parameter_meshes,
)
from qwen35_fs2.recipes.gang import Qwen35GangSection
from qwen35_fs2.parallel.grad_norm import ShardedGradClipFacade

AuxLossFn: TypeAlias = Callable[[], MoeStatistics]
"""
Returns the routing statistics of the last forward pass of the model: the
unweighted auxiliary loss (the load-balancing loss of its MoE layers) and the
loads of its experts.
"""


@dataclass(kw_only=True)
class LMLossSection:
    chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE
    """
    The number of tokens whose logits are computed at once. The fp32
    log-probabilities of a chunk take ``chunk_size * 248320 * 4`` bytes with
    the Qwen3.5 vocabulary.
    """

    aux_loss_weight: float = 0.001
    """
    The weight of the auxiliary loss of the model, the load-balancing loss of
    MoE layers (``router_aux_loss_coef`` in Hugging Face). Dense models have
    none.
    """

    mtp_loss_weight: float = 0.1
    """
    The weight of the loss of the model's multi-token-prediction head, the
    cross entropy of its predictions of the token after next (as
    Megatron-Bridge's ``mtp_loss_scaling_factor``), relative to the
    next-token loss; reported as ``mtp_loss``. Models without a head
    (``mtp_num_layers: 0``) have none. With 0, the head is frozen: an export
    then carries it as it was loaded, untrained with the model.
    """

    def validate(self) -> ValidationResult:
        result = ValidationResult()

        if self.chunk_size < 1:
            result.add_error(
                f"`chunk_size` must be greater than or equal to 1, but is {self.chunk_size} instead."
            )

        if self.aux_loss_weight < 0.0:
            result.add_error(
                f"`aux_loss_weight` must be greater than or equal to 0, but is {self.aux_loss_weight} instead."
            )

        if self.mtp_loss_weight < 0.0:
            result.add_error(
                f"`mtp_loss_weight` must be greater than or equal to 0, but is {self.mtp_loss_weight} instead."
            )

        return result


class _LMTrainingConfig(RestoredConfig, Protocol):
    model: ModelSection

    loss: LMLossSection

    lora: LoraConfig | None

    gang: Qwen35GangSection


class LMTrainingRecipe(Recipe):
    """The base of ``lm train`` and ``lm instruction_finetune``: Hugging Face
    checkpoints load straight into each rank's shards, the loss is the chunked
    cross entropy plus the MoE load-balancing loss, and MoE models train
    without a static autograd graph. Subclasses build the data readers."""

    def __init__(self) -> None:
        self._has_moe = False

        self._ep_groups: ExpertParallelGroups | None = None

    @override
    def register(self, container: DependencyContainer) -> None:
        register_lm_recipe_extras(container)

        enable_sharded_checkpoint_loading(container)

    @override
    def setup_model(
        self, context: RecipeContext, model: Module, newly_initialized: bool
    ) -> Module:
        config = cast(_LMTrainingConfig, context.get_config_as(self.config_kls))

        check_restored_config(context, config)

        # Before the model is sharded: FSDP2 shards the adapters too.
        if config.lora is not None:
            setup_lora(context, model, config.lora)

        # Before the model is sharded: FSDP2 shards the rank's experts only.
        self._ep_groups = setup_expert_parallelism(context, model, config.gang.expert_parallel_size)

        model = finish_sharded_checkpoint_loading(context, model)

        self._has_moe = has_moe_layers(model)

        return setup_lm_loss(model, config.loss)

    def create_lm_trainer(
        self,
        context: RecipeContext,
        train_reader: DataReader[SequenceBatch],
        valid_reader: DataReader[SequenceBatch] | None,
    ) -> Task:
        """Returns the trainer of the language-model loss on ``train_reader``,
        validating on ``valid_reader`` if given, and exporting its checkpoints
        to Hugging Face if the regime asks (:mod:`qwen35_fs2.recipes.hf_export`)."""
        config = cast(_LMTrainingConfig, context.get_config_as(self.config_kls))

        dp_model = context.get_data_parallel_model()

        # Before the trainer exists: it takes the facade of the model then.
        if self._ep_groups is not None or context.gangs.tp.size > 1:
            facade = ShardedGradClipFacade(get_data_parallel_facade(dp_model), dp_model, context.gangs)

            set_data_parallel_facade(dp_model, facade)

            log.info("Gradients are clipped by their norm over all {} ranks (tensor parallel size {}).", context.gangs.root.size, context.gangs.tp.size)  # fmt: skip

        # A MoE run may resume a checkpoint of another EP size.
        if self._has_moe:
            keep_optimizer_state_on_parameter_meshes(context.get_optimizer())

        if config.lora is not None:
            save_adapters_only(dp_model)

        aux_loss_fn = create_aux_loss_fn(dp_model)

        loss_computer = LMLossComputer(
            dp_model, aux_loss_fn, config.loss.aux_loss_weight, mtp_loss_weight=config.loss.mtp_loss_weight
        )

        unit = LMTrainUnit(loss_computer, compiled=config.model.compile)

        # Before the trainer exists: fairseq2 creates its exporter with it.
        hf_exporter = take_over_hf_export(context, lora=config.lora is not None)

        if valid_reader is None:
            trainer = context.create_trainer(unit, train_reader)
        else:
            valid_unit = LMLossEvalUnit(loss_computer)

            trainer = context.create_trainer(unit, train_reader, [valid_unit], [valid_reader])

        # SIGUSR1 (SLURM's warning before the time limit), or the stop file of
        # our SLURM launcher, must stop training.
        stop_on_signal(trainer, stop_file=stop_file_from_env())

        if hf_exporter is None:
            return trainer

        return export_hf_checkpoints(trainer, hf_exporter)


def setup_expert_parallelism(context: RecipeContext, model: Module, ep_size: int) -> ExpertParallelGroups | None:
    """Splits the routed experts of ``model`` over expert-parallel groups of
    ``ep_size`` data-parallel ranks (:mod:`qwen35_fs2.parallel.expert_parallel`)
    and returns the groups; ``None`` and nothing done for ``ep_size`` 1."""
    if ep_size == 1:
        return None

    trainer = context.resolver.resolve(TrainerSection)

    if trainer.data_parallelism != "fsdp":
        raise RecipeError(
            f"`gang.expert_parallel_size` ({ep_size}) needs `trainer.data_parallelism: fsdp`, but it is '{trainer.data_parallelism}' instead."
        )

    # At `model` granularity fairseq2 shards the whole model itself, experts
    # included, over all data-parallel ranks.
    if trainer.fsdp.granularity not in ("layer", "stack"):
        raise RecipeError(
            f"`gang.expert_parallel_size` ({ep_size}) needs `trainer.fsdp.granularity` 'layer' or 'stack', but it is '{trainer.fsdp.granularity}' instead."
        )

    if not has_moe_layers(model):
        raise RecipeError(f"`gang.expert_parallel_size` is {ep_size}, but the model has no MoE layers.")

    try:
        groups = create_expert_parallel_groups(context.gangs, ep_size)

        apply_expert_parallelism(model, groups)
    except (ValueError, NotSupportedError) as ex:
        raise RecipeError(f"`gang.expert_parallel_size` ({ep_size}) cannot be used: {ex}") from ex

    log.info("Expert parallelism: {} ranks per group, {} per replica group.", ep_size, context.gangs.dp.size // ep_size)

    return groups


def setup_lm_loss(model: Module, section: LMLossSection) -> Module:
    """Installs the chunked loss with the configured chunk size, on models
    created or loaded by the recipe, with the loss of the MTP head if the
    model has one: trained if ``section.mtp_loss_weight`` is positive,
    otherwise frozen and measured in validation only."""
    if not isinstance(model, TransformerLM):
        raise RecipeError(
            f"The model must be a `TransformerLM`, but is a `{type(model).__name__}` instead."
        )

    mtp = find_mtp(model)

    mtp_loss: MtpLossMode = "off"

    if mtp is not None:
        if section.mtp_loss_weight > 0.0:
            mtp_loss = "train"

            # LoRA freezes the head and puts no adapters on it.
            if not any(p.requires_grad for p in mtp.parameters()):
                log.warning("The MTP head of the model is frozen, but `loss.mtp_loss_weight` is {}: its loss trains the rest of the model to suit a head that cannot follow. Set `loss.mtp_loss_weight: 0` to train on the next-token loss alone; validation then still measures the head.", section.mtp_loss_weight)  # fmt: skip
        else:
            # Unused parameters would also break DDP's gradient reduction.
            mtp.requires_grad_(False)

            log.info("The MTP head of the model is frozen (`loss.mtp_loss_weight` is 0); validation measures it.")

            mtp_loss = "eval"

    return install_chunked_lm_loss(model, chunk_size=section.chunk_size, mtp_loss=mtp_loss)


def has_moe_layers(model: Module) -> bool:
    return any(isinstance(m, Qwen35MoeBlock) for m in model.modules())


def create_aux_loss_fn(model: Module) -> AuxLossFn | None:
    """Returns the function that collects the load-balancing loss of the MoE
    layers of ``model`` after each forward pass, or ``None`` if ``model`` has
    no MoE layers."""
    if not has_moe_layers(model):
        return None

    def collect_aux_loss() -> MoeStatistics:
        statistics = collect_moe_statistics(model)

        if statistics is None:
            raise InternalError("`statistics` is `None`.")

        return statistics

    return collect_aux_loss


class NonFiniteLossError(Exception):
    """Raised when the loss of a training batch is NaN or infinite."""

    step_nr: int
    loss: float

    def __init__(self, step_nr: int, loss: float, num_examples: int, num_targets: int) -> None:
        super().__init__(
            f"The loss of a training batch is {loss} at step {step_nr} ({num_examples} examples, {num_targets} target tokens). Lower the learning rate, check the data, or resume from an earlier checkpoint."
        )

        self.step_nr = step_nr
        self.loss = loss


def _handle_non_finite_loss_error(ex: NonFiniteLossError) -> int:
    log.error("{} Training stopped.", ex)

    return 3


def register_lm_recipe_extras(container: DependencyContainer) -> None:
    """Registers the metric names and error handlers of our LM recipes."""

    def register(name: str, display_name: str, priority: int, formatter: MetricFormatter) -> None:
        descriptor = MetricDescriptor(name, display_name, priority, formatter)

        container.collection.register_instance(MetricDescriptor, descriptor)

    register("mtp_loss", "MTP Loss", 104, format_as_float)
    register("mtp_acceptance", "MTP Acceptance", 104, format_as_float)
    register("speculative_acceptance", "Speculative Acceptance", 220, format_as_float)
    register("speculative_tokens_per_second", "Speculative Tokens per Second", 221, format_as_int)
    register("plain_tokens_per_second", "Plain Greedy Tokens per Second", 222, format_as_int)
    register("speculative_speedup", "Speculative Speed-up", 223, format_as_float)
    register("speculative_mismatches", "Speculative Mismatches", 224, format_as_int)
    register("aux_loss", "Auxiliary Loss", 105, format_as_float)
    register("moe_max_tokens_per_expert", "Most Tokens of an Expert", 106, format_as_int)
    register("moe_min_tokens_per_expert", "Fewest Tokens of an Expert", 107, format_as_int)
    register("moe_dropped_tokens", "Dropped Expert Assignments", 108, format_as_int)
    register("moe_ep_imbalance", "Expert-Parallel Imbalance", 109, format_as_float)
    register("compiled_graphs", "Compiled Graphs", 110, format_as_int)
    register("graph_breaks", "Graph Breaks", 111, format_as_int)
    register("num_correct", "Number of Correct Answers", 210, format_as_int)
    register("num_truncated", "Number of Truncated Responses", 211, format_as_int)

    # In language-model recipes, elements are tokens. The later registration
    # replaces fairseq2's name.
    register("elements_per_second", "Tokens per Second", 810, format_as_int)

    register_cli_error(container, NonFiniteLossError, _handle_non_finite_loss_error)


def get_sft_pad_idx(tokenizer: Tokenizer) -> int:
    """Returns the pad index of the tokenizer, which pads SFT batches and is
    excluded from the loss."""
    vocab_info = tokenizer.vocab_info

    pad_idx = vocab_info.pad_idx

    if pad_idx is None:
        raise RecipeError(
            "The tokenizer must have a pad token to batch SFT examples, but has none. Set `tokenizer.config_overrides.pad_token` to a token other than the end-of-sequence token."
        )

    if vocab_info.eos_idx == pad_idx:
        raise RecipeError(
            f"The end-of-sequence token ({pad_idx}) must differ from the pad token in SFT, or the model never learns to stop. Set `tokenizer.config_overrides.eos_token: <|im_end|>`."
        )

    return pad_idx


def check_sft_vocabulary(model: TransformerLM, tokenizer: Tokenizer) -> None:
    """Checks that the model and the tokenizer agree on the vocabulary and on
    the pad token."""
    _check_vocabulary_size(model, tokenizer)

    pad_idx = get_sft_pad_idx(tokenizer)

    if model.pad_idx != pad_idx:
        raise RecipeError(
            f"The pad index of the model ({model.pad_idx}) must match the pad token of the tokenizer ({pad_idx}). Set `model.config_overrides.pad_idx: {pad_idx}`."
        )


def check_pretraining_vocabulary(model: TransformerLM, tokenizer: Tokenizer) -> None:
    """Checks that the model and the tokenizer agree on the vocabulary and that
    the end-of-document targets count in the loss."""
    vocab_info = tokenizer.vocab_info

    _check_vocabulary_size(model, tokenizer)

    if vocab_info.eos_idx is None:
        raise RecipeError(
            "The tokenizer must have an end-of-sequence token to separate documents, but has none."
        )

    if model.pad_idx is not None and model.pad_idx == vocab_info.eos_idx:
        raise RecipeError(
            f"The pad index of the model ({model.pad_idx}) must not be the end-of-document token, or the loss ignores every document end. Set `model.config_overrides.pad_idx: null`."
        )


def check_valid_files_apart(train_files: Sequence[Path], valid_files: Sequence[Path], *, hint: str) -> None:
    """Raises :class:`RecipeError` if the validation reads training files: its
    loss would not be a held-out loss. ``hint`` says how to fix the config."""
    shared = sorted(find_shared_files(valid_files, train_files))

    if shared:
        shown = ", ".join(str(file) for file in shared[:3])

        more = f" and {len(shared) - 3} more" if len(shared) > 3 else ""

        raise RecipeError(
            f"`dataset.valid` must read other files than `dataset.train`, but reads {len(shared)} of its files ({shown}{more}) instead. {hint}"
        )


def _check_vocabulary_size(model: TransformerLM, tokenizer: Tokenizer) -> None:
    num_embeddings = model.final_proj.output_dim

    vocab_size = tokenizer.vocab_info.size

    if num_embeddings < vocab_size:
        raise RecipeError(
            f"The model must have at least as many embeddings as the tokenizer has tokens ({vocab_size}), but has {num_embeddings}."
        )


def get_batch_target_mask(batch: SequenceBatch) -> Tensor | None:
    """Returns the mask of the targets of ``batch`` that count in the loss:
    its own target mask, or else its non-pad positions if it is padded."""
    if batch.target_mask is not None:
        return batch.target_mask

    if batch.padding == 0:
        return None

    seqs = batch.seqs

    if batch.packed:
        return torch.arange(seqs.size(0), device=seqs.device) < batch.num_elements

    seq_lens = torch.tensor(batch.seq_lens, device=seqs.device)

    positions = torch.arange(seqs.size(1), device=seqs.device)

    return positions.unsqueeze(0) < seq_lens.unsqueeze(1)


@final
class LMLossComputer:
    """Computes the summed next-token loss of a batch, adds the weighted
    auxiliary loss of the model and the weighted loss of its MTP head, and
    updates the metrics."""

    def __init__(
        self,
        model: Module,
        aux_loss_fn: AuxLossFn | None = None,
        aux_loss_weight: float = 0.0,
        *,
        mtp_loss_weight: float = 0.0,
    ) -> None:
        """
        :param mtp_loss_weight: The weight of the loss of the MTP head, if
            the model has one; the model computes it if
            :func:`setup_lm_loss` installed it (in training only with a
            positive weight).
        """
        self._model = model
        self._aux_loss_fn = aux_loss_fn
        self._aux_loss_weight = aux_loss_weight
        self._mtp = find_mtp(model)
        self._mtp_loss_weight = mtp_loss_weight

    def prepare_metric_bag(self, metric_bag: MetricBag, *, evaluation: bool = False) -> None:
        """
        :param evaluation: If ``True``, the bag of an evaluation, in which
            the MTP head's acceptance is measured too.
        """
        add_nll_loss_metric(metric_bag)

        add_seq_batch_metrics(metric_bag)

        if self._mtp is not None:
            # Per MTP target.
            if self._mtp_loss_weight > 0.0 or evaluation:
                metric_bag.add("mtp_loss", Mean())

            if evaluation:
                # Per MTP target; computed by the model in evaluation mode.
                metric_bag.add("mtp_acceptance", Mean())

        if self._aux_loss_fn is not None:
            metric_bag.add("aux_loss", Mean())

            # Over the layers and experts of one batch on one rank.
            metric_bag.add("moe_max_tokens_per_expert", Max())
            metric_bag.add("moe_min_tokens_per_expert", Min())
            metric_bag.add("moe_dropped_tokens", Sum())
            metric_bag.add("moe_ep_imbalance", Max())

    def __call__(self, batch: SequenceBatch, metric_bag: MetricBag) -> tuple[Tensor, int]:
        model = cast(CausalLM, self._model)

        input_batch, target_batch = batch.as_auto_regressive()

        seqs, seqs_layout = input_batch.as_input()

        nll_loss = model(
            seqs,
            seqs_layout,
            targets=target_batch.seqs,
            target_mask=get_batch_target_mask(target_batch),
            reduction="sum",
        )

        num_targets = target_batch.num_target_elements

        update_nll_loss_metric(metric_bag, nll_loss, num_targets=num_targets)

        update_seq_batch_metrics(metric_bag, target_batch)

        loss = nll_loss

        mtp_loss = None if self._mtp is None else self._mtp.pop_loss()

        if mtp_loss is None and self._mtp is not None and self._mtp_loss_weight > 0.0:
            raise InternalError("The model computed no MTP loss.")

        if mtp_loss is not None:
            # A batch may have no MTP target (documents of one token).
            num_mtp_targets = mtp_loss.num_targets.clamp(min=1)

            mean_mtp_loss = mtp_loss.nll_loss / num_mtp_targets

            metric_bag.get("mtp_loss", Mean).update(mean_mtp_loss.detach(), weight=mtp_loss.num_targets)

            # Measured in evaluation mode, where the bag has the metric.
            if mtp_loss.num_accepted is not None:
                metric_bag.get("mtp_acceptance", Mean).update(
                    mtp_loss.num_accepted / num_mtp_targets, weight=mtp_loss.num_targets
                )

            # Summed over the MTP targets, as `loss` over the next-token ones:
            # the trainer divides both by the next-token targets of the whole
            # step (all micro-batches, all ranks), so that every MTP target
            # weighs the same however the step's tokens are split (Megatron's
            # per-token loss). A mean per micro-batch weighted by its
            # next-token targets would weigh the MTP targets of micro-batches
            # of short documents (one target fewer per document) more.
            if self._mtp_loss_weight > 0.0:
                loss = loss + self._mtp_loss_weight * mtp_loss.nll_loss

        # The auxiliary loss of the model (MoE load balancing) is a per-batch
        # mean, while `loss` is summed over targets and normalized by their
        # number after the backward pass: scale it alike.
        if self._aux_loss_fn is not None:
            moe_statistics = self._aux_loss_fn()

            aux_loss = moe_statistics.load_balancing_loss

            # Weighted as it weighs in the step's loss.
            metric_bag.get("aux_loss", Mean).update(aux_loss.detach(), weight=num_targets)

            metric_bag.get("moe_max_tokens_per_expert", Max).update(moe_statistics.max_tokens_per_expert)
            metric_bag.get("moe_min_tokens_per_expert", Min).update(moe_statistics.min_tokens_per_expert)
            metric_bag.get("moe_dropped_tokens", Sum).update(moe_statistics.num_dropped_assignments)
            metric_bag.get("moe_ep_imbalance", Max).update(moe_statistics.ep_imbalance)

            loss = loss + (self._aux_loss_weight * num_targets) * aux_loss

        return loss, num_targets


@final
class LMTrainUnit(TrainUnit[SequenceBatch]):
    """Trains a causal language model on the targets of each batch (all tokens
    in pretraining, the response tokens in SFT)."""

    def __init__(self, loss_computer: LMLossComputer, *, compiled: bool = False) -> None:
        """
        :param compiled: If ``True``, the model runs under ``torch.compile``:
            each step reports the number of graphs compiled so far and of
            the graph breaks compiled around (the metrics ``compiled_graphs``
            and ``graph_breaks``); a step that compiled any logs how many,
            and a step that met new graph breaks warns with their reasons.
        """
        self._loss_computer = loss_computer
        self._compiled = compiled
        self._num_graphs = 0
        self._graph_breaks: dict[str, int] = {}
        self._step_nr = 0

    @override
    def prepare_metric_bag(self, metric_bag: MetricBag) -> None:
        self._loss_computer.prepare_metric_bag(metric_bag)

        if self._compiled:
            metric_bag.add("compiled_graphs", Max())
            metric_bag.add("graph_breaks", Max())

    @override
    def set_step_nr(self, step_nr: int) -> None:
        self._step_nr = step_nr

    @override
    def process_batch(self, batch: SequenceBatch, metric_bag: MetricBag) -> tuple[Tensor, int]:
        loss, num_targets = self._loss_computer(batch, metric_bag)

        if self._compiled:
            # Counted after the forward pass, which compiles the graphs of
            # both passes (and those of the validation before this step).
            num_graphs = compiled_graph_count()

            if num_graphs > self._num_graphs:
                log.info(
                    "torch.compile compiled {} graph(s) by step {} ({} in all); after the first steps, a recompilation (`TORCH_LOGS=recompiles` says why).",
                    num_graphs - self._num_graphs, self._step_nr, num_graphs,
                )  # fmt: skip

                self._num_graphs = num_graphs

            metric_bag.get("compiled_graphs", Max).update(num_graphs)

            graph_breaks = graph_break_reasons()

            new_breaks = {
                reason: count - self._graph_breaks.get(reason, 0)
                for reason, count in graph_breaks.items()
                if count > self._graph_breaks.get(reason, 0)
            }

            if new_breaks:
                log.warning(
                    "torch.compile met {} graph break(s) by step {} ({} in all): {}. Each runs the code after it in another graph, and under activation checkpointing its whole layer eagerly; `TORCH_LOGS=graph_breaks` says where.",
                    sum(new_breaks.values()), self._step_nr, sum(graph_breaks.values()),
                    "; ".join(f"{count} x {reason}" for reason, count in new_breaks.items()),
                )  # fmt: skip

                self._graph_breaks = graph_breaks

            metric_bag.get("graph_breaks", Max).update(sum(graph_breaks.values()))

        # A non-finite loss would silently turn every weight into NaN. The
        # process exits, so `torchrun` and `srun` end the other ranks too.
        if not torch.isfinite(loss.detach()).item():
            raise NonFiniteLossError(self._step_nr, loss.item(), batch.num_examples, num_targets)

        return loss, num_targets


@final
class LMLossEvalUnit(EvalUnit[SequenceBatch]):
    """Reports the next-token loss of validation batches."""

    def __init__(self, loss_computer: LMLossComputer) -> None:
        self._loss_computer = loss_computer

    @override
    def prepare_metric_bag(self, metric_bag: MetricBag) -> None:
        self._loss_computer.prepare_metric_bag(metric_bag, evaluation=True)

    @override
    def process_batch(self, batch: SequenceBatch, metric_bag: MetricBag) -> None:
        if is_idle_batch(batch):
            # The forward pass takes part in the other ranks' exchanges; its
            # metrics go to a bag of their own, which nobody reads.
            metric_bag = MetricBag(batch.seqs.device)

            self.prepare_metric_bag(metric_bag)

        self._loss_computer(batch, metric_bag)
