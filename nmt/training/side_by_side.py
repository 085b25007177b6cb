"""``--models N``: several models trained at once, side by side, to decode as an ensemble.

Each model is the run its seed would be alone (--seed + k, SAVE_DIR/modelK), in a process of its
own with 1/N of the threads and the whole --max-time: N models make about 1/N of the updates one
model would. That pays where one model's quality has stopped rising within the budget, which
depends on the machine's speed: with --min-model-updates, a few timed updates before training
decide how many of the N models the time affords, and the log says so.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time

import torch

from nmt.checkpoint.names import member_dirs
from nmt.device import resolve_device, using_threads
from nmt.errors import NmtError
from nmt.log import logger
from nmt.training.config import TrainConfig
from nmt.training.distributed import DistributedContext, launched_by_torchrun, spawn, warn_if_more_than_cores
from nmt.training.inputs import check_inputs
from nmt.training.iterator import EpochIterator
from nmt.training.trainer import Trainer, TrainSummary, train

# The updates a --min-model-updates forecast times, after as many untimed ones (allocation, warm caches).
TIMED_UPDATES = 10
UNTIMED_UPDATES = 3


def train_models(config: TrainConfig) -> list[TrainSummary]:
    """Train the models ``--models`` (and ``--min-model-updates``) ask for; one trains as ``train`` does.

    The first model's progress is logged, the others' warnings and errors only.
    """
    if config.models == 1:
        return [train(config)]
    if launched_by_torchrun():
        raise NmtError("--models trains each model in a process of its own: leave it out under torchrun")
    threads = config.compute.threads or torch.get_num_threads()
    count = affordable_models(config, threads)
    if count == 1:  # in SAVE_DIR/model1 all the same, where the recipe's later stages look for it
        return [train(dataclasses.replace(config, models=1, save_dir=str(member_dirs(config.save_dir, 2)[0])))]
    if resolve_device(config.compute.device).type == "cpu":
        warn_if_more_than_cores(count, "--models")
    compute = dataclasses.replace(config.compute, threads=max(1, threads // count))
    members = [(index, dataclasses.replace(config, models=1, seed=config.seed + index, save_dir=str(directory),
                                           compute=compute))
               for index, directory in enumerate(member_dirs(config.save_dir, config.models)[:count])]
    logger.info("training %d models side by side (seeds %s), each in %s with %d thread(s); the log follows model 1",
                count, ", ".join(str(member.seed) for _, member in members),
                " and ".join(member.save_dir for _, member in members), compute.threads)
    return spawn(train_member, members, group=False)


def train_member(member: tuple[int, TrainConfig]) -> TrainSummary:
    """One of ``--models N``, in its own process."""
    index, config = member
    if index > 0:
        logger.setLevel(logging.WARNING)
    return train(config)


def affordable_models(config: TrainConfig, threads: int) -> int:
    """How many of ``--models`` models to train: all of them, or with --min-model-updates (and
    --max-time), the most that each still make that many updates in the time at the speed timed here."""
    if not config.min_model_updates:
        return config.models
    for count in range(config.models, 1, -1):
        seconds = seconds_per_update(config, max(1, threads // count))
        updates = config.max_time_seconds / seconds
        enough = updates >= config.min_model_updates
        logger.info("%d models side by side would make about %s updates each in --max-time %s (%.2f s an update on "
                    "%d thread(s), %d timed): %s --min-model-updates %s", count, f"{updates:,.0f}", config.max_time,
                    seconds, max(1, threads // count), TIMED_UPDATES, "at least" if enough else "fewer than",
                    f"{config.min_model_updates:,}")
        if enough:
            return count
    logger.info("training 1 model of --models %d, on all %d thread(s)", config.models, threads)
    return 1


def seconds_per_update(config: TrainConfig, threads: int) -> float:
    """The time of one of the run's updates on ``threads`` threads, timed in this process on the first
    batches of its first epoch (nothing is saved; validation is not counted)."""
    device = resolve_device(config.compute.device)
    level = logger.level
    logger.setLevel(logging.WARNING)  # the run itself logs what opening its inputs finds
    try:
        with tempfile.TemporaryDirectory(prefix="nmt-timing-") as scratch, using_threads(threads):
            timed = dataclasses.replace(config, models=1, save_dir=scratch, tensorboard_dir=None)
            trainer = Trainer(timed, DistributedContext(), check_inputs(timed, device), device)
            split = trainer.data.for_epoch(1)
            updates = iter(EpochIterator(split.dataset, split.batches, seed=config.seed, epoch=1,
                                         update_freq=config.update_freq, prefetch=config.prefetch))
            for step in range(UNTIMED_UPDATES + TIMED_UPDATES):
                if step == UNTIMED_UPDATES:
                    started = time.perf_counter()
                update = next(updates, None)
                if update is None:  # an epoch shorter than the timing: what was timed
                    return (time.perf_counter() - started) / max(1, step - UNTIMED_UPDATES)
                trainer.train_step(update)
                trainer.state.update += 1
            return (time.perf_counter() - started) / TIMED_UPDATES
    finally:
        logger.setLevel(level)
