"""``--models N``: several models trained at once, side by side, to decode as an ensemble.

Each model is the run its seed would be alone (--seed + k, SAVE_DIR/modelK), in a process of its
own with its share of the threads and the whole --max-time: N models make about 1/N of the
updates one model would. That pays where one model's quality has stopped rising within the
budget, which depends on the machine's speed: with --min-model-updates, a few timed updates
before training decide how many of the N models the time affords, and the log says so. A re-run
resumes the models its save dir holds, without timing again.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import tempfile
import time
from pathlib import Path

import torch

from nmt.checkpoint.names import LAST, member_dirs
from nmt.device import resolve_device, using_threads
from nmt.errors import NmtError
from nmt.log import logger
from nmt.training.config import TrainConfig
from nmt.training.distributed import DistributedContext, launched_by_torchrun, spawn
from nmt.training.inputs import TrainingData, check_inputs
from nmt.training.iterator import EpochIterator
from nmt.training.trainer import Trainer, TrainSummary, check_directories, train

# The updates a --min-model-updates forecast times, after as many untimed ones (allocation, warm caches).
TIMED_UPDATES = 10
UNTIMED_UPDATES = 3


def train_models(config: TrainConfig) -> list[TrainSummary]:
    """Train the models ``--models`` (and ``--min-model-updates``) ask for; one trains as ``train`` does.

    The first model's progress is logged, the others' warnings and errors, and each one's end.
    """
    if config.models == 1:
        return [train(config)]
    check_directories(config)
    if launched_by_torchrun():
        raise NmtError("--models trains each model in a process of its own: leave it out under torchrun")
    if config.cpu_processes is not None:
        raise NmtError("--models trains each model in one process, on its share of the threads: leave out "
                       "--cpu-processes")
    device = resolve_device(config.compute.device)
    threads = config.compute.threads or torch.get_num_threads()
    if device.type == "cpu" and threads < config.models and not config.min_model_updates:
        raise NmtError(f"--models {config.models} on {threads} thread(s): each model needs one; give more --threads "
                       "or fewer models")
    started = [directory for directory in member_dirs(config.save_dir, config.models) if (directory / LAST).is_file()]
    if started:
        count = len(started)
        logger.info("resuming the %d model(s) %s holds", count, config.save_dir)
    else:
        count = affordable_models(config, device, threads)
    if count == 1:  # in SAVE_DIR/model1 all the same, where the recipe's later stages look for it
        return [train(one_model(config, save_dir=str(member_dirs(config.save_dir, config.models)[0])))]
    shares = [threads // count + (index < threads % count) for index in range(count)]
    members = [(index, member_config(config, index, share)) for index, share in enumerate(shares)]
    logger.info("training %d models side by side (seeds %s), each in %s with %s thread(s); the log follows model 1",
                count, ", ".join(str(member.seed) for _, member in members),
                " and ".join(member.save_dir for _, member in members), "/".join(map(str, shares)))
    summaries = spawn(train_member, members, group=False)
    for index, summary in enumerate(summaries, 1):
        logger.info("model %d: %s updates, %d epochs, best valid loss %s (%s)", index, f"{summary.updates:,}",
                    summary.epoch, "-" if summary.best_valid_loss is None else f"{summary.best_valid_loss:.3f}",
                    summary.stop_reason)
    return summaries


def member_config(config: TrainConfig, index: int, threads: int) -> TrainConfig:
    """Model ``index`` (from 0) of ``--models``: seed + index, in its member dir (its TensorBoard scalars
    too), one process on ``threads`` threads."""
    directory = member_dirs(config.save_dir, config.models)[index]
    return one_model(config, seed=config.seed + index, save_dir=str(directory),
                     tensorboard_dir=str(Path(config.tensorboard_dir) / directory.name) if config.tensorboard_dir
                     else None, cpu_processes=1, compute=dataclasses.replace(config.compute, threads=threads))


def one_model(config: TrainConfig, **changes) -> TrainConfig:
    """``config`` for one of its models, which trains alone."""
    return dataclasses.replace(config, models=1, min_model_updates=0, **changes)


def train_member(member: tuple[int, TrainConfig]) -> TrainSummary:
    """One of ``--models N``, in its own process."""
    index, config = member
    if index > 0:
        logger.setLevel(logging.WARNING)
    return train(config)


def affordable_models(config: TrainConfig, device: torch.device, threads: int) -> int:
    """How many of ``--models`` models to train: all of them, or with --min-model-updates (and
    --max-time), the most that each still make that many updates in the time at the speed timed here
    on the threads each would have (validation not counted), one thread at least each."""
    if not config.min_model_updates:
        return config.models
    if device.type != "cpu":
        raise NmtError("--min-model-updates weighs the CPU threads the models share; on a GPU give --models alone")
    started = time.perf_counter()
    data = check_inputs(one_model(config), device)
    for count in range(min(config.models, threads), 1, -1):  # a model needs a thread
        seconds, timed = seconds_per_update(config, data, device, threads // count)
        updates = config.max_time_seconds / seconds
        enough = updates >= config.min_model_updates
        logger.info("%d models side by side would make about %s updates each in --max-time %s (%.2f s an update on "
                    "%d thread(s), %d timed): %s --min-model-updates %s", count, f"{updates:,.0f}", config.max_time,
                    seconds, threads // count, timed, "at least" if enough else "fewer than",
                    f"{config.min_model_updates:,}")
        if enough:
            break
    else:
        count = 1
        logger.info("training 1 model of --models %d, on all %d thread(s)", config.models, threads)
    logger.info("the forecast took %.0f s", time.perf_counter() - started)
    return count


def seconds_per_update(config: TrainConfig, data: TrainingData, device: torch.device, threads: int
                       ) -> tuple[float, int]:
    """The time of one of the run's updates on ``threads`` threads, timed in this process on its first
    batches (nothing is saved), and how many updates were timed."""
    level = logger.level
    logger.setLevel(logging.WARNING)  # the run itself logs what its model and precision are
    try:
        with tempfile.TemporaryDirectory(prefix="nmt-timing-") as scratch, using_threads(threads):
            timed = one_model(config, save_dir=scratch, tensorboard_dir=None)
            trainer = Trainer(timed, DistributedContext(), data, device)
            epochs = (EpochIterator(data.for_epoch(epoch).dataset, data.for_epoch(epoch).batches, seed=config.seed,
                                    epoch=epoch, update_freq=config.update_freq, prefetch=0)
                      for epoch in range(1, UNTIMED_UPDATES + TIMED_UPDATES + 1))  # a short epoch: the next ones
            updates = list(itertools.islice(itertools.chain.from_iterable(epochs), UNTIMED_UPDATES + TIMED_UPDATES))
            for position, update in enumerate(updates):
                if position == UNTIMED_UPDATES:
                    begun = time.perf_counter()
                trainer.train_step(update)
                trainer.state.update += 1
            return (time.perf_counter() - begun) / (len(updates) - UNTIMED_UPDATES), len(updates) - UNTIMED_UPDATES
    finally:
        logger.setLevel(level)
