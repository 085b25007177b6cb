"""``nmt train``: the training loop, from a data directory and an arch to checkpoints.

One update = ``update_freq`` batches per process, times the number of processes. Its loss is
the sum of the label-smoothed token losses divided by the target tokens of the whole update, so
2 processes x 1 batch and 1 process x ``update_freq 2`` over the same batches take the same step.
Each batch's dropout is seeded from (seed, epoch, position of the batch in the epoch), which
makes the weights a function of the batches alone: the same whether the run was split across
processes or interrupted and resumed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from nmt.checkpoint import Vocabularies, model_state
from nmt.data.dataset import DataDir
from nmt.data.vocabulary import PAD_ID
from nmt.device import autocast, resolve_device, resolve_precision
from nmt.errors import NmtError
from nmt.log import logger, stderr_console
from nmt.models.registry import build_model, count_parameters, get_arch, resolve_config
from nmt.training import checkpoints as ckpt
from nmt.training.config import TrainConfig, config_to_dict, write_config
from nmt.training.distributed import (DistributedContext, StopRequest, all_reduce_sum, init_distributed,
                                      launched_by_torchrun, shutdown_distributed, spawn)
from nmt.training.iterator import EpochIterator, Update, make_batches
from nmt.training.loss import label_smoothed_cross_entropy
from nmt.training.lr_scheduler import InverseSqrtSchedule
from nmt.training.progress import Display, Meter, summary_table
from nmt.training.validation import validation_bleu, validation_loss

MAX_OOM_SKIPS = 10  # out-of-memory batches skipped before giving up


@dataclass
class TrainState:
    """Where training stands; saved in every checkpoint as ``train_state``."""

    epoch: int = 1  # the epoch in progress (or next to start)
    position: int = 0  # global batches of that epoch already trained on
    update: int = 0  # optimizer steps taken
    best_valid_loss: float | None = None
    bad_validations: int = 0  # validations since the best one (for --patience)
    elapsed: float = 0.0  # training seconds over all runs (for --max-time)


@dataclass
class TrainSummary:
    save_dir: str
    epoch: int  # the last epoch trained on (completed or not)
    updates: int
    train_loss: float | None  # over this run's updates, per target token
    valid_loss: float | None  # the last validation
    valid_ppl: float | None
    valid_bleu: float | None  # the last validation's, with --eval-bleu
    best_valid_loss: float | None
    stop_reason: str
    seconds: float  # this run's wall clock
    tokens_per_second: float  # target tokens, this run


def train(config: TrainConfig) -> TrainSummary:
    """Train as the config says, in this process, in ``nproc`` spawned ones, or as a torchrun rank."""
    config.validate()
    if config.nproc > 1:
        if launched_by_torchrun():
            raise NmtError("--nproc spawns its own workers; under torchrun leave it out (use --nproc-per-node)")
        if resolve_device(config.device).type == "cuda" and torch.cuda.device_count() < config.nproc:
            raise NmtError(f"--nproc {config.nproc} needs {config.nproc} GPUs; {torch.cuda.device_count()} visible")
        Trainer(config, DistributedContext(0, config.nproc), check_only=True)  # bad input fails here, once
        return spawn(train_worker, config, config.nproc)
    return train_worker(config)


def train_worker(config: TrainConfig) -> TrainSummary:
    device = resolve_device(config.device)
    context = init_distributed(device.type)
    try:
        return Trainer(config, context).fit()
    finally:
        shutdown_distributed()


def batch_seed(seed: int, epoch: int, position: int) -> int:
    return int(np.random.SeedSequence([seed, epoch, position]).generate_state(1)[0])


class Trainer:
    def __init__(self, config: TrainConfig, context: DistributedContext, check_only: bool = False):
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and context.is_distributed:
            self.device = torch.device("cuda", context.local_rank)
        precision, self.precision_reason = resolve_precision(config.precision, self.device)
        autocast(self.device, precision)  # fp16 on CPU is refused here
        config = dataclasses.replace(config, precision=precision)  # the run config stores what ran
        self.config, self.context = config, context
        self.data = DataDir.open(config.data)
        source_lang, target_lang = self.data.source_lang, self.data.target_lang
        self.vocabs = Vocabularies(source_lang, target_lang, self.data.vocabulary(source_lang),
                                   self.data.vocabulary(target_lang))
        arch = get_arch(config.arch)
        self.model_config = resolve_config(arch.config, config.model)
        self.train_set = self.data.split(config.train_subset)
        self.batches = make_batches(self.train_set, config.max_tokens, config.max_sentences,
                                    config.required_batch_size_multiple, config.skip_invalid_size_inputs)
        if len(self.batches) < context.world_size:
            raise NmtError(f"the training set makes {len(self.batches)} batches, fewer than the "
                           f"{context.world_size} processes; lower --max-tokens or use fewer processes")
        self.valid_set = self.valid_batches = None
        if config.valid_subset is not None and config.valid_subset not in self.data.splits:
            if config.valid_subset != "valid":
                raise NmtError(f"{config.data} has no split {config.valid_subset!r} to validate on; "
                               f"it has: {', '.join(self.data.splits)}")
            logger.warning("%s has no 'valid' split: training without validation (and without %s)",
                           config.data, ckpt.BEST)
        elif config.valid_subset is not None:
            self.valid_set = self.data.split(config.valid_subset)
            longest = int(np.maximum(self.valid_set.source.sizes, self.valid_set.target.sizes).max(initial=1))
            max_tokens = None if config.max_tokens is None else max(config.max_tokens, longest)
            self.valid_batches = make_batches(self.valid_set, max_tokens, config.max_sentences)
        if config.lr is None and not hasattr(self.model_config, "d_model"):
            raise NmtError(f"arch {config.arch} has no d_model for the paper's learning rate; give --lr")
        if check_only:
            return

        torch.manual_seed(config.seed)
        self.model = build_model(arch.model_name, self.model_config, len(self.vocabs.source),
                                 len(self.vocabs.target), PAD_ID).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.0, betas=config.adam_betas,
                                           eps=config.adam_eps, weight_decay=config.weight_decay,
                                           fused=True)  # one kernel for all parameters: 5x faster on CPU
        self.scheduler = InverseSqrtSchedule(config.warmup_updates, getattr(self.model_config, "d_model", 0),
                                             config.lr)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=config.precision == "fp16")
        self.save_dir = Path(config.save_dir)
        self.state = TrainState()
        self.resume()
        # Built after every rank has read its checkpoint: DDP's first broadcast keeps rank 0 from saving before.
        self.network = (DistributedDataParallel(self.model, device_ids=[self.device.index] if self.device.type == "cuda"
                                                else None) if context.is_distributed else self.model)
        self.display = Display(context.is_main, show_bar=logger.isEnabledFor(logging.INFO),
                               tensorboard_dir=config.tensorboard_dir)
        self.out_of_memory = 0
        self.last_valid: dict[str, float] | None = None
        self.improved = False  # set by validate(): the last validation gave a new best loss
        self.time_up = False  # --max-time reached, as all processes agreed at the last update

    # -- resume and save -------------------------------------------------------------------------------

    def resume(self) -> None:
        found = ckpt.find_resume_checkpoint(self.save_dir, self.config.restore_file)
        if found is None:
            return
        path, checkpoint = found
        ckpt.check_compatible(checkpoint, path, self.model.model_name, self.config.arch,
                              dataclasses.asdict(self.model_config), self.vocabs)
        self.model.load_state_dict(checkpoint["model"])
        if "train_state" not in checkpoint:
            logger.info("initialised the model from %s (a model-only checkpoint: training starts at update 0)", path)
            return
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        if checkpoint.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(checkpoint["scaler"])
        ckpt.set_rng_state(checkpoint["rng"])
        self.state = TrainState(**checkpoint["train_state"])
        before = checkpoint.get("train_config", {}).get("train", {})
        now = config_to_dict(self.config)["train"]
        changed = [f"{key} {before[key]!r} -> {now[key]!r}" for key in now if key in before and before[key] != now[key]]
        logger.info("resuming from %s: epoch %d, update %d%s", path, self.state.epoch, self.state.update,
                    f" (changed: {', '.join(changed)})" if changed else "")

    def checkpoint(self) -> dict[str, Any]:
        state = model_state(self.model, self.config.arch, self.model_config, self.vocabs)
        state.update(optimizer=self.optimizer.state_dict(), scheduler=self.scheduler.state_dict(),
                     scaler=self.scaler.state_dict(), rng=ckpt.rng_state(), train_state=dataclasses.asdict(self.state),
                     train_config=config_to_dict(self.config, self.model_config))
        return state

    def save(self, names: list[str]) -> None:
        self.state.elapsed = self.elapsed()
        if self.context.is_main and names:
            ckpt.write_checkpoints(self.save_dir, self.checkpoint(), names)
            ckpt.prune_checkpoints(self.save_dir, self.config.keep_last_epochs, self.config.keep_interval_updates)

    def elapsed(self) -> float:
        return self.elapsed_before + time.monotonic() - self.started

    # -- one update --------------------------------------------------------------------------------------

    def train_step(self, update: Update) -> tuple[torch.Tensor, float | None]:
        """Forward/backward over the update's batches and one optimizer step.

        Returns this process's (loss, nll, target tokens, sentences) sums and the gradient norm,
        or None for it when the step was skipped (fp16 overflow, out of memory).
        """
        self.network.train()
        self.scheduler.set_lr(self.optimizer, self.state.update + 1)
        self.optimizer.zero_grad(set_to_none=True)
        scale = self.context.world_size / max(update.num_tokens, 1)  # DDP averages over processes; undo that
        sums = torch.zeros(4, device=self.device)
        try:
            for i, (batch, position) in enumerate(zip(update.batches, update.positions)):
                torch.manual_seed(batch_seed(self.config.seed, self.state.epoch, position))
                batch = batch.to(self.device)
                sync = i == len(update.batches) - 1 or not self.context.is_distributed
                with contextlib.nullcontext() if sync else self.network.no_sync():
                    with autocast(self.device, self.config.precision):
                        logits = self.network(batch.source, batch.prev_output)
                    loss, nll = label_smoothed_cross_entropy(logits, batch.target, self.config.label_smoothing, PAD_ID)
                    self.scaler.scale(loss * scale).backward()
                sums += torch.stack([loss.detach(), nll.detach(), batch.target.ne(PAD_ID).sum().to(loss.dtype),
                                     torch.tensor(float(len(batch)), device=self.device)])
        except torch.cuda.OutOfMemoryError:
            return sums.zero_(), self.skip_out_of_memory(update)
        self.scaler.unscale_(self.optimizer)
        max_norm = self.config.clip_norm if self.config.clip_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        if self.scaler.is_enabled():
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scaler.get_scale() < scale_before:
                logger.warning("fp16 overflow at update %d: skipped it; loss scale now %g",
                               self.state.update + 1, self.scaler.get_scale())
                return sums, None
        elif not math.isfinite(grad_norm):
            raise NmtError(f"the gradient norm became {grad_norm} at update {self.state.update + 1}; "
                           "lower --lr, raise --warmup-updates or set --clip-norm")
        else:
            self.optimizer.step()
        return sums, grad_norm

    def skip_out_of_memory(self, update: Update) -> None:
        shapes = ", ".join(f"{len(b)}x{b.target.size(1)}" for b in update.batches)
        if self.context.is_distributed:
            raise NmtError(f"out of memory at update {self.state.update + 1} on rank {self.context.rank} "
                           f"(batches {shapes}); lower --max-tokens")
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.out_of_memory += 1
        logger.warning("out of memory at update %d (batches %s): skipped it (%d so far)", self.state.update + 1,
                       shapes, self.out_of_memory)
        if self.out_of_memory >= MAX_OOM_SKIPS:
            raise NmtError(f"out of memory on {self.out_of_memory} updates; lower --max-tokens")
        return None

    # -- validation ------------------------------------------------------------------------------------

    def validate(self) -> None:
        """Validation loss (and BLEU with --eval-bleu); updates the best loss and the patience count."""
        if self.valid_set is None:
            return
        self.model.eval()
        figures = validation_loss(self.model, self.valid_set, self.valid_batches, self.config.label_smoothing,
                                  self.config.precision, self.device, self.context, self.config.prefetch)
        if self.config.eval_bleu:
            figures["bleu"] = validation_bleu(self.model, self.valid_set, self.vocabs, self.config.eval_bleu_beam,
                                              self.config.max_tokens, self.config.precision, self.device,
                                              self.context)
        self.last_valid = figures
        if self.state.best_valid_loss is None or figures["loss"] < self.state.best_valid_loss:
            self.state.best_valid_loss = figures["loss"]
            self.state.bad_validations = 0
            self.improved = True
        else:
            self.state.bad_validations += 1
        self.display.valid_line(self.config.valid_subset, self.state.epoch, self.state.update, figures,
                                self.state.best_valid_loss)

    # -- the loop --------------------------------------------------------------------------------------

    def limit_reached(self) -> str | None:
        config, state = self.config, self.state
        if config.max_update and state.update >= config.max_update:
            return f"reached --max-update {config.max_update}"
        if config.max_epoch and state.epoch > config.max_epoch:
            return f"reached --max-epoch {config.max_epoch}"
        if config.patience and state.bad_validations >= config.patience:
            return f"no better validation loss in {config.patience} validations (--patience)"
        return None

    def fit(self) -> TrainSummary:
        config, state, context = self.config, self.state, self.context
        self.started, self.elapsed_before = time.monotonic(), state.elapsed
        if context.is_main:
            self.save_dir.mkdir(parents=True, exist_ok=True)
            write_config(self.save_dir / "config.yaml", config, self.model_config)
        logger.info("%s: %s parameters on %s (%s), %d process(es); %d training batches per epoch, "
                    "update = %d batch(es) x %d process(es)", config.arch, f"{count_parameters(self.model):,}",
                    self.device, config.precision, context.world_size, len(self.batches), config.update_freq,
                    context.world_size)
        if context.is_main:
            logger.info("precision: %s (%s)", config.precision, self.precision_reason)
        run_meter = Meter()
        stop = self.limit_reached()
        if stop:
            logger.info("nothing to do: %s", stop)
        with StopRequest(second_aborts=not context.is_distributed) as interrupt:
            while stop is None:
                stop = self.train_epoch(run_meter, interrupt)
        self.display.close()
        figures = run_meter.figures()
        summary = TrainSummary(
            save_dir=str(self.save_dir), epoch=state.epoch - (state.position == 0), updates=state.update,
            train_loss=figures["loss"] if run_meter.tokens else None,
            valid_loss=self.last_valid["loss"] if self.last_valid else None,
            valid_ppl=self.last_valid["ppl"] if self.last_valid else None,
            valid_bleu=self.last_valid.get("bleu") if self.last_valid else None, best_valid_loss=state.best_valid_loss,
            stop_reason=stop, seconds=time.monotonic() - self.started,
            tokens_per_second=figures["tokens_per_second"] if run_meter.tokens else 0.0)
        if stop.startswith("interrupted"):
            logger.warning("%s", stop)
            raise KeyboardInterrupt
        if context.is_main and logger.isEnabledFor(logging.INFO):
            stderr_console.print(summary_table({
                "arch": config.arch, "epochs": summary.epoch, "updates": summary.updates,
                "train loss (this run)": summary.train_loss, "valid loss": summary.valid_loss,
                "valid ppl": summary.valid_ppl, **({"valid BLEU": summary.valid_bleu} if config.eval_bleu else {}),
                "best valid loss": summary.best_valid_loss,
                "target tokens/s": int(summary.tokens_per_second), "wall clock": f"{summary.seconds:.1f} s",
                "stopped": summary.stop_reason, "checkpoints": str(self.save_dir)}))
        return summary

    def train_epoch(self, run_meter: Meter, interrupt: StopRequest) -> str | None:
        """Train from the current position to the end of the epoch or a stop; the stop reason."""
        config, state, context = self.config, self.state, self.context
        epoch = EpochIterator(self.train_set, self.batches, config.seed, state.epoch, context.world_size,
                              context.rank, config.update_freq, state.position, config.prefetch,
                              self.device.type == "cuda")
        interval = Meter()
        max_time = config.max_time_seconds
        total = epoch.num_updates()
        with self.display.epoch(state.epoch, total, total - epoch.num_updates(state.position)):
            for update in epoch:
                sums, grad_norm = self.train_step(update)
                # Every process must agree to stop at the same update: the flags travel with the sums.
                time_up = context.is_main and max_time is not None and self.elapsed() >= max_time
                flags = torch.tensor([interrupt.requested, time_up], dtype=sums.dtype, device=self.device)
                totals = all_reduce_sum(torch.cat([sums, flags]), context).tolist()
                state.position = update.position
                stepped = grad_norm is not None
                state.update += stepped
                for meter in (interval, run_meter):
                    meter.add(*totals[:4], grad_norm)
                lr = self.optimizer.param_groups[0]["lr"]
                self.display.advance(interval.figures(), lr)
                if stepped and state.update % config.log_interval == 0:
                    self.display.train_line(state.epoch, state.update, interval.figures(), lr)
                    interval = Meter()
                self.time_up = bool(totals[5])
                if totals[4]:
                    self.save([ckpt.LAST])
                    return f"interrupted at update {state.update}: saved {ckpt.LAST}; re-run the same command to resume"
                if update.position == epoch.num_batches:
                    break  # the epoch's end validates and saves below
                stop = f"reached --max-time {config.max_time}" if self.time_up else self.limit_reached()
                self.improved = False
                if stop or (stepped and config.validate_interval_updates
                            and state.update % config.validate_interval_updates == 0):
                    self.validate()
                names = [ckpt.BEST] if self.improved else []
                if stepped and config.save_interval_updates and state.update % config.save_interval_updates == 0:
                    names += [ckpt.update_checkpoint_name(state.epoch, state.update), ckpt.LAST]
                stop = stop or self.limit_reached()  # patience, after a validation
                if stop and ckpt.LAST not in names:
                    names.append(ckpt.LAST)
                self.save(names)
                if stop:
                    return stop
        self.improved = False
        self.validate()
        finished = state.epoch
        state.epoch, state.position = state.epoch + 1, 0
        names = [ckpt.epoch_checkpoint_name(finished), ckpt.LAST] + ([ckpt.BEST] if self.improved else [])
        if config.save_interval_updates and state.update and state.update % config.save_interval_updates == 0:
            names.append(ckpt.update_checkpoint_name(finished, state.update))  # no gap for averaging by update
        self.save(names)
        return self.limit_reached() or (f"reached --max-time {config.max_time}" if self.time_up else None)
