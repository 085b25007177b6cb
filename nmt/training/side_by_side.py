"""``--models N``: several models trained at once, side by side, to decode as an ensemble.

Each model is the run its seed would be alone (--seed + k, SAVE_DIR/modelK), in a process of its
own with its share of the threads (on a GPU, they share it) and the whole --max-time: each makes
fewer updates than one model would (on 2 cores, 60% of one model's on both), which pays only where
one model's quality has stopped rising within the budget (docs/results.md: not on Multi30k's
2-hour CPU budget). A re-run resumes each model.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from nmt.checkpoint.names import member_dirs
from nmt.errors import NmtError
from nmt.log import logger
from nmt.training.config import TrainConfig
from nmt.training.distributed import launched_by_torchrun, spawn
from nmt.training.trainer import TrainSummary, check_directories, train


def train_models(config: TrainConfig) -> list[TrainSummary]:
    """Train the models ``--models`` asks for; one trains as ``train`` does.

    The first model's progress is logged, the others' warnings and errors, and each one's end.
    """
    if config.models == 1:
        return [train(config)]
    check_directories(config)
    if launched_by_torchrun():
        raise NmtError("--models trains each model in a process of its own: leave it out under torchrun")
    threads = config.compute.threads or torch.get_num_threads()
    if threads < config.models:  # torch's own count (--threads given is checked with the options)
        raise NmtError(f"--models {config.models} on {threads} thread(s): each model needs one; give more --threads "
                       "or fewer models")
    shares = [threads // config.models + (index < threads % config.models) for index in range(config.models)]
    members = [(index, member_config(config, index, share)) for index, share in enumerate(shares)]
    logger.info("training %d models side by side (seeds %s), each in %s with %s thread(s); the log follows model 1",
                config.models, ", ".join(str(member.seed) for _, member in members),
                " and ".join(member.save_dir for _, member in members), "/".join(map(str, shares)))
    summaries = spawn(train_member, members, group=False)
    for index, summary in enumerate(summaries, 1):
        logger.info("model %d: %s", index, summary.outcome())
    return summaries


def member_config(config: TrainConfig, index: int, threads: int) -> TrainConfig:
    """Model ``index`` (from 0) of ``--models``: seed + index, in its member dir (its TensorBoard scalars
    too), one process on ``threads`` threads."""
    directory = member_dirs(config.save_dir, config.models)[index]
    return dataclasses.replace(config, models=1, seed=config.seed + index, save_dir=str(directory),
                               tensorboard_dir=str(Path(config.tensorboard_dir) / directory.name)
                               if config.tensorboard_dir else None, cpu_processes=1,
                               compute=dataclasses.replace(config.compute, threads=threads))


def train_member(member: tuple[int, TrainConfig]) -> TrainSummary:
    """One of ``--models N``, in its own process."""
    index, config = member
    if index > 0:
        logger.setLevel(logging.WARNING)
    return train(config)
