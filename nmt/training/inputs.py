"""What a training run reads, opened and checked before anything runs: the data directory and its
vocabularies, the arch's resolved config, and the batch lists of the training and validation splits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from nmt.checkpoint.names import BEST
from nmt.data.dataset import DataDir, ParallelDataset
from nmt.data.vocabulary import Vocabularies
from nmt.device import autocast, resolve_device
from nmt.errors import NmtError
from nmt.log import logger
from nmt.models.registry import get_arch, resolve_config
from nmt.scoring import MetricOptions, bleu_metric
from nmt.training.config import TrainConfig
from nmt.training.iterator import TrainingBatches, check_positions, make_batches


@dataclass
class TrainingData:
    """Everything training reads from the data directory, checked."""

    vocabs: Vocabularies
    model_config: Any
    train_set: ParallelDataset
    batches: TrainingBatches  # composed anew each epoch
    valid_set: ParallelDataset | None
    valid_batches: list[np.ndarray] | None


def check_inputs(config: TrainConfig, world_size: int = 1) -> TrainingData:
    """Open and check every input of a run (data, arch, batches, devices); an NmtError says what is wrong."""
    autocast(resolve_device(config.device), config.precision)  # fp16 on CPU is refused here
    data = DataDir.open(config.data)
    arch = get_arch(config.arch)
    model_config = resolve_config(arch.config, config.model)
    if config.lr is None and not hasattr(model_config, "d_model"):
        raise NmtError(f"arch {config.arch} has no d_model for the paper's learning rate; give --lr")
    max_positions = getattr(model_config, "max_positions", None)
    train_set = data.split(config.train_subset)
    batches = TrainingBatches(train_set, config.max_tokens, config.max_sentences, config.required_batch_size_multiple,
                              config.skip_invalid_size_inputs, max_positions)
    if len(batches) < world_size:
        raise NmtError(f"the training set makes {len(batches)} batches, fewer than the "
                       f"{world_size} processes; lower --max-tokens or use fewer processes")
    valid_set = valid_batches = None
    if config.valid_subset is not None and config.valid_subset not in data.splits:
        if config.valid_subset != "valid":
            raise NmtError(f"{config.data} has no split {config.valid_subset!r} to validate on; "
                           f"it has: {', '.join(data.splits)}")
        logger.warning("%s has no 'valid' split: training without validation (and without %s)",
                       config.data, BEST)
    elif config.valid_subset is not None:
        valid_set = data.split(config.valid_subset)
        sizes = np.maximum(valid_set.source.sizes, valid_set.target.sizes)
        max_tokens = None if config.max_tokens is None else max(config.max_tokens, int(sizes.max(initial=1)))
        valid_batches = make_batches(valid_set, max_tokens, config.max_sentences)
        if max_positions is not None and not config.skip_invalid_size_inputs:
            check_positions(valid_set, config.valid_subset, max_positions)
        elif max_positions is not None and sizes.max(initial=0) > max_positions:
            logger.warning("validating without the %d %s pairs longer than the model's max_positions %d",
                           int((sizes > max_positions).sum()), config.valid_subset, max_positions)
            valid_batches = [kept for batch in valid_batches if len(kept := batch[sizes[batch] <= max_positions])]
    if config.eval_bleu and valid_set is not None:  # a missing tokenizer package found now, not after an epoch
        bleu_metric(MetricOptions(config.eval_bleu_tokenize, config.eval_bleu_lowercase, language=data.target_lang))
    return TrainingData(data.vocabularies(), model_config, train_set, batches, valid_set, valid_batches)
