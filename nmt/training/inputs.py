"""What a training run reads, opened and checked before anything runs: the data directory and its
vocabularies, the arch's resolved config, and the batch lists of the training and validation splits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nmt.checkpoint.names import BEST
from nmt.data.dataset import DataDir, ParallelDataset
from nmt.data.vocabulary import Vocabularies
from nmt.device import autocast
from nmt.errors import NmtError
from nmt.log import logger
from nmt.models.registry import get_arch, resolve_config
from nmt.options import flag
from nmt.scoring import MetricOptions, bleu_metric
from nmt.training.config import TrainConfig
from nmt.training.iterator import TrainingBatches, check_positions, make_batches


@dataclass
class ValidationSplit:
    name: str
    dataset: ParallelDataset
    batches: list[np.ndarray]  # in length order: validation needs no shuffling
    pairs: np.ndarray  # the indices in those batches, sorted: what --eval-bleu translates


@dataclass
class TrainingSplit:
    dataset: ParallelDataset
    batches: TrainingBatches  # composed anew each epoch


@dataclass
class TrainingData:
    """Everything training reads from the data directory, checked."""

    vocabs: Vocabularies
    model_config: Any
    train: list[TrainingSplit]  # read in turn, one an epoch: the split, or its sampled segmentations
    valid: list[ValidationSplit]  # the first decides checkpoint_best.pt and --patience; empty: no validation

    def for_epoch(self, epoch: int) -> TrainingSplit:
        """What epoch ``epoch`` (from 1) trains on: a pure function of the epoch, so a resumed run reads the same."""
        return self.train[(epoch - 1) % len(self.train)]


def check_inputs(config: TrainConfig, device: torch.device, world_size: int = 1) -> TrainingData:
    """Open and check every input of a run (data, arch, batches, devices); an NmtError says what is wrong."""
    autocast(device, config.compute.precision)  # fp16 on CPU is refused here
    data = DataDir.open(config.data)
    arch = get_arch(config.arch)
    model_config = resolve_config(arch.config, config.model)
    if config.lr is None and not hasattr(model_config, "d_model"):
        raise NmtError(f"arch {config.arch} has no d_model for the paper's learning rate; give --lr")
    vocabs = data.vocabularies()
    if getattr(model_config, "share_embeddings", None) == "all" and not vocabs.joint:
        raise NmtError(f"{config.arch} ties the source and target embeddings (share_embeddings: all), which needs a "
                       f"joint vocabulary; {config.data} has one per language: preprocess with --joint, or give "
                       "--set share_embeddings=decoder")
    max_positions = getattr(model_config, "max_positions", None)
    train = []
    for dataset in data.samples(config.train_subset) or [data.split(config.train_subset)]:
        batches = TrainingBatches(dataset, config.max_tokens, config.max_sentences,
                                  config.required_batch_size_multiple, config.skip_invalid_size_inputs, max_positions)
        if len(batches) < world_size:
            raise NmtError(f"the training set makes {len(batches)} batches, fewer than the "
                           f"{world_size} processes; lower --max-tokens or use fewer processes")
        train.append(TrainingSplit(dataset, batches))
    if len(train) > 1:
        logger.info("training on %d segmentations of %s sampled by preprocess (--subword-samples), one an epoch",
                    len(train), config.train_subset)
    valid = []
    for name in config.valid_subsets:
        if name not in data.splits and config.valid_subsets == ["valid"]:
            if needs := config.needs_validation():
                raise NmtError(f"{config.data} has no 'valid' split, and {flag(needs)} needs validation")
            logger.warning("%s has no 'valid' split: training without validation (and without %s)",
                           config.data, BEST)
        elif name not in data.splits:
            raise NmtError(f"{config.data} has no split {name!r} to validate on; it has: {', '.join(data.splits)}")
        else:
            valid.append(validation_split(data.split(name), name, config, max_positions))
    if config.eval_bleu and valid:  # a missing tokenizer package found now, not after an epoch
        bleu_metric(MetricOptions(config.eval_bleu_tokenize, config.eval_bleu_lowercase, language=data.target_lang))
    return TrainingData(vocabs, model_config, train, valid)


def validation_split(dataset: ParallelDataset, name: str, config: TrainConfig,
                     max_positions: int | None) -> ValidationSplit:
    """A split's validation batches: any pair fits --max-tokens (a batch of its own); one over the
    model's positions is an error, or left out with --skip-invalid-size-inputs."""
    sizes = np.maximum(dataset.source.sizes, dataset.target.sizes)
    max_tokens = None if config.max_tokens is None else max(config.max_tokens, int(sizes.max(initial=1)))
    batches = make_batches(dataset, max_tokens, config.max_sentences)
    pairs = np.arange(len(dataset))
    if max_positions is not None and not config.skip_invalid_size_inputs:
        check_positions(dataset, name, max_positions)
    elif max_positions is not None and sizes.max(initial=0) > max_positions:
        logger.warning("validating without the %d %s pairs longer than the model's max_positions %d",
                       int((sizes > max_positions).sum()), name, max_positions)
        batches = [kept for batch in batches if len(kept := batch[sizes[batch] <= max_positions])]
        pairs = np.flatnonzero(sizes <= max_positions)
    return ValidationSplit(name, dataset, batches, pairs)
