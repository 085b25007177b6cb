"""Validation during training: loss and perplexity, and optionally BLEU with a short beam.

``record_validation`` decides whether a validation is the best so far (by loss, or by BLEU with
``--best-checkpoint-metric bleu``): that choice makes checkpoint_best.pt and counts ``--patience``.

Each process takes its share of the validation set; the sums (or the translations) are
combined across processes, so every process sees the same figures.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from nmt.checkpoint.format import Vocabularies
from nmt.data.vocabulary import PAD_ID
from nmt.device import autocast
from nmt.generation.inference import TranslationRequest, translate_ids
from nmt.generation.options import BatchingOptions, SearchOptions
from nmt.scoring import MetricOptions, score
from nmt.training.config import TrainConfig
from nmt.training.distributed import DistributedContext, all_reduce_sum
from nmt.training.inputs import ValidationSplit
from nmt.training.iterator import sharded_batches
from nmt.training.loss import label_smoothed_cross_entropy
from nmt.training.progress import perplexity
from nmt.training.state import TrainState


def validation_figures(model: nn.Module, split: ValidationSplit, vocabs: Vocabularies, config: TrainConfig,
                       device: torch.device, context: DistributedContext) -> dict[str, float]:
    """One split's loss, nll and perplexity, and its BLEU with --eval-bleu; the model must be in eval mode."""
    figures = validation_loss(model, split, config, device, context)
    if config.eval_bleu:
        figures["bleu"] = validation_bleu(model, split, vocabs, config, device, context)
    return figures


@torch.no_grad()
def validation_loss(model: nn.Module, split: ValidationSplit, config: TrainConfig, device: torch.device,
                    context: DistributedContext) -> dict[str, float]:
    """Label-smoothed loss, nll and perplexity per target token (nats)."""
    sums = torch.zeros(3, device=device)
    for batch in sharded_batches(split.dataset, split.batches, world_size=context.world_size, rank=context.rank,
                                 prefetch=config.prefetch, pin_memory=device.type == "cuda"):
        batch = batch.to(device)
        with autocast(device, config.compute.precision):
            states = model(batch.source, batch.prev_output, features_only=True)
            loss, nll = label_smoothed_cross_entropy(states, model.output_weight(), batch.target,
                                                     config.label_smoothing, PAD_ID)
        sums += torch.stack([loss, nll, batch.target.ne(PAD_ID).sum().to(loss.dtype)])
    loss_sum, nll_sum, tokens = all_reduce_sum(sums, context).tolist()
    return {"loss": loss_sum / tokens, "nll": nll_sum / tokens, "ppl": perplexity(nll_sum / tokens)}


def validation_bleu(model: nn.Module, split: ValidationSplit, vocabs: Vocabularies, config: TrainConfig,
                    device: torch.device, context: DistributedContext) -> float:
    """Corpus BLEU (sacrebleu) of beam-search translations of the split's validated pairs against the
    decoded references.

    The references are the binarized targets decoded by sentencepiece, i.e. normalized text,
    close to but not always the raw reference file: a figure to watch, not to report.
    """
    dataset = split.dataset
    mine = split.pairs[context.rank::context.world_size].tolist()
    search = SearchOptions(beam=config.eval_bleu_beam, stop="exact")  # a figure of the model, not of a fast setting
    batching = BatchingOptions(max_tokens=config.max_tokens, batch_size=config.max_sentences)
    hypotheses = translate_ids(model, [dataset.source[i] for i in mine],
                               TranslationRequest(search, batching, device, config.compute.precision))
    pairs = [(vocabs.target.decode(hyps[0].tokens), vocabs.target.decode(dataset.target[i]))
             for hyps, i in zip(hypotheses, mine)]
    if context.is_distributed:
        gathered: list[list[tuple[str, str]]] = [[] for _ in range(context.world_size)]
        dist.all_gather_object(gathered, pairs)
        pairs = [pair for shard in gathered for pair in shard]
    options = MetricOptions(config.eval_bleu_tokenize, config.eval_bleu_lowercase, language=vocabs.target_lang)
    (bleu,) = score([hypothesis for hypothesis, _ in pairs], [[reference for _, reference in pairs]], options=options)
    return bleu.score


def record_validation(state: TrainState, figures: dict[str, float], metric: str) -> bool:
    """Update the best figures and the patience count; True when this validation is the best by ``metric``.

    The best loss is tracked whatever the metric (the summary shows it); BLEU is higher-better.
    """
    loss_improved = state.best_valid_loss is None or figures["loss"] < state.best_valid_loss
    if loss_improved:
        state.best_valid_loss = figures["loss"]
    improved = loss_improved
    if metric == "bleu":
        improved = state.best_valid_bleu is None or figures["bleu"] > state.best_valid_bleu
        if improved:
            state.best_valid_bleu = figures["bleu"]
    state.bad_validations = 0 if improved else state.bad_validations + 1
    return improved
