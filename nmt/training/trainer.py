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
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from nmt.checkpoint.format import check_compatible, load_checkpoint, model_state
from nmt.checkpoint.names import BEST, LAST
from nmt.data.vocabulary import PAD_ID
from nmt.device import autocast, resolve_device, resolve_precision, using_threads
from nmt.errors import NmtError, Stopped
from nmt.generation.decoding_settings import RECORD_KEY
from nmt.log import logger, stderr_console
from nmt.log import state as log_state
from nmt.models.registry import build_model, count_parameters, get_arch, resolve_config
from nmt.training import checkpoints as ckpt
from nmt.training.config import TrainConfig, config_to_dict, write_config
from nmt.training.decoding_check import first_pairs, save_with_record, timed_check
from nmt.training.distributed import (
    DistributedContext,
    StopRequest,
    all_reduce_sum,
    init_distributed,
    launched_by_torchrun,
    processes_for_this_machine,
    shutdown_distributed,
    spawn,
)
from nmt.training.inputs import TrainingData, check_inputs
from nmt.training.iterator import EpochIterator, Update
from nmt.training.loss import label_smoothed_cross_entropy
from nmt.training.lr_scheduler import make_schedule, set_lr
from nmt.training.metrics_file import FILE_NAME as METRICS_FILE
from nmt.training.metrics_file import MetricsFile
from nmt.training.progress import Display, Meter, StepResult, summary_table
from nmt.training.state import TrainState
from nmt.training.validation import record_validation, validation_figures

MAX_OOM_SKIPS = 10  # out-of-memory batches skipped before giving up


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
    skipped_updates: int = 0  # fp16 overflows (and out-of-memory skips): no step taken, not in train_loss

    def outcome(self) -> str:
        """How the run ended, in one line (`nmt run`'s table, each of --models' ends)."""
        if self.best_valid_loss is None:
            return f"{self.updates} updates ({self.stop_reason})"
        return f"{self.updates} updates, {self.epoch} epochs, best valid loss {self.best_valid_loss:.3f} " \
               f"({self.stop_reason})"


@dataclass(frozen=True)
class Job:
    """What a training process starts from: the config, its resolved device and, in a ``--nproc``
    worker, the inputs the parent checked (a single process or a torchrun rank opens its own)."""

    config: TrainConfig
    device: torch.device
    data: TrainingData | None = None


def check_directories(config: TrainConfig) -> None:
    """A data directory is given, and the checkpoints do not go into it (`nmt preprocess` replaces it whole)."""
    if not config.data:
        raise NmtError("give the data directory (DATA_DIR, or `data:` in the recipe)")
    if Path(config.save_dir).resolve() == Path(config.data).resolve():
        raise NmtError(f"--save-dir {config.save_dir} is the data directory: give the checkpoints a directory of "
                       "their own (`nmt preprocess` replaces its directory whole)")


def train(config: TrainConfig) -> TrainSummary:
    """Train as the config says, in this process, in ``nproc`` spawned ones, or as a torchrun rank.

    The process that saves (rank 0) holds the save dir's lock for the whole run.
    """
    if config.models > 1:
        raise NmtError(f"train() trains one model: train_models() trains --models {config.models}")
    check_directories(config)
    device = resolve_device(config.compute.device)
    model_config = resolve_config(get_arch(config.arch).config, config.model)
    config = processes_for_this_machine(config, device, getattr(model_config, "max_positions", 0))
    saves = int(os.environ.get("RANK", 0)) == 0
    with ckpt.claim_save_dir(Path(config.save_dir)) if saves else contextlib.nullcontext():
        if config.nproc == 1:
            return train_process(Job(config, device))
        if launched_by_torchrun():
            raise NmtError("--nproc spawns its own workers; under torchrun leave it out (use --nproc-per-node)")
        if device.type == "cuda" and torch.cuda.device_count() < config.nproc:
            raise NmtError(f"--nproc {config.nproc} needs {config.nproc} GPUs; {torch.cuda.device_count()} visible")
        data = check_inputs(config, device, config.nproc)  # bad input fails here, before any worker starts
        return spawn(train_process, [Job(config, device, data)] * config.nproc)[0]


def train_process(job: Job) -> TrainSummary:
    """One training process: this one, a ``--nproc`` worker or a torchrun rank."""
    with using_threads(job.config.compute.threads, int(os.environ.get("LOCAL_WORLD_SIZE", 1))):  # --nproc shares them
        return train_in_this_process(job)


def train_in_this_process(job: Job) -> TrainSummary:
    context = init_distributed(job.device.type)
    try:
        data = job.data if job.data is not None else check_inputs(job.config, job.device, context.world_size)
        trainer = Trainer(job.config, context, data, job.device)
        summary = trainer.fit()
    except BaseException:
        shutdown_distributed(together=False)  # a peer may be gone: no barrier to wait at
        raise
    shutdown_distributed(together=True)
    if context.is_main and job.config.check_decoding:
        with using_threads(job.config.compute.threads):  # the peers' threads too, now that they have left
            trainer.check_decoding()  # once the peers have left, which would otherwise wait for it at the barrier
    return summary


def batch_seed(seed: int, epoch: int, position: int) -> int:
    return int(np.random.SeedSequence([seed, epoch, position]).generate_state(1)[0])


class Trainer:
    def __init__(self, config: TrainConfig, context: DistributedContext, data: TrainingData, device: torch.device):
        """``data`` as check_inputs gives it; ``device`` as resolve_device does (with several processes
        on GPUs, each takes the one of its local rank)."""
        self.device = torch.device("cuda", context.local_rank) if device.type == "cuda" and context.is_distributed \
            else device
        precision, self.precision_reason = resolve_precision(config.compute.precision, self.device)
        config = dataclasses.replace(config, compute=dataclasses.replace(config.compute, precision=precision))  # as ran
        self.config, self.context, self.data = config, context, data
        self.vocabs, self.model_config = data.vocabs, data.model_config

        torch.manual_seed(config.seed)
        self.model = build_model(get_arch(config.arch).model_name, self.model_config, len(self.vocabs.source),
                                 len(self.vocabs.target), PAD_ID).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.0, betas=config.adam_betas,
                                           eps=config.adam_eps, weight_decay=config.weight_decay,
                                           fused=True)  # one kernel for all parameters: 5x faster on CPU
        self.scheduler = make_schedule(config.lr_schedule, config.warmup_updates,
                                       getattr(self.model_config, "d_model", 0), config.lr, config.max_update,
                                       config.max_time_seconds, config.warmup_share)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=config.compute.precision == "fp16")
        self.save_dir = Path(config.save_dir)
        self.state = TrainState()
        self.resume()
        # Built after every rank has read its checkpoint: DDP's first broadcast keeps rank 0 from saving before.
        self.network = (DistributedDataParallel(self.model, device_ids=[self.device.index] if self.device.type == "cuda"
                                                else None) if context.is_distributed else self.model)
        self.display = Display(context.is_main, show_bar=logger.isEnabledFor(logging.INFO),
                               tensorboard_dir=config.tensorboard_dir,
                               metrics=MetricsFile(self.save_dir / METRICS_FILE, self.state.update)
                               if context.is_main else None)
        self.out_of_memory = 0
        self.last_valid: dict[str, float] | None = None

    # -- resume and save -------------------------------------------------------------------------------

    def resume(self) -> None:
        found = ckpt.find_resume_checkpoint(self.save_dir, self.config.restore_file, self.config.finetune_from_model)
        if found is None:
            return
        path, checkpoint, in_save_dir = found
        expected = model_state(self.model, self.config.arch, self.model_config, self.vocabs)
        if in_save_dir:
            check_compatible(checkpoint, expected, f"{path} does not match this run (another --save-dir starts a "
                             "new one)", "to resume it, give the checkpoint's --arch and --set")
        else:
            flag = "--restore-file" if self.config.restore_file else "--finetune-from-model"
            check_compatible(checkpoint, expected, f"{flag} {path} does not match this run",
                             "give the checkpoint's --arch and --set")
        self.model.load_state_dict(checkpoint["model"])
        if "train_state" not in checkpoint:
            logger.info("initialised the model from %s (its weights only: training starts at update 0)", path)
            return
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        for group in self.optimizer.param_groups:  # this run's settings, not the saved ones (as the log says)
            group.update(betas=self.config.adam_betas, eps=self.config.adam_eps, weight_decay=self.config.weight_decay)
        if checkpoint.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(checkpoint["scaler"])
        ckpt.set_rng_state(checkpoint["rng"])
        self.state = TrainState(**checkpoint["train_state"])
        before = checkpoint.get("train_config", {}).get("train", {})
        now = config_to_dict(self.config)["train"]
        changed = [f"{key} {before[key]!r} -> {now[key]!r}" for key in now if key in before and before[key] != now[key]]
        logger.info("resuming from %s: epoch %d, update %d%s", path, self.state.epoch, self.state.update,
                    f" (changed: {', '.join(changed)})" if changed else "")
        cut = [key for key in BATCH_CUT if key in before and before[key] != now[key]]
        if cut and self.state.position:
            logger.warning("epoch %d was cut into batches by %s, now by %s: it starts again from its first batch, so "
                           "that none of its pairs is left out (those of its first %d batches are trained twice)",
                           self.state.epoch, ", ".join(f"{key} {before[key]}" for key in cut),
                           ", ".join(f"{key} {now[key]}" for key in cut), self.state.position)
            self.state = dataclasses.replace(self.state, position=0)
        repeated = batches_trained_again(self.state.position, self.context.world_size)
        if repeated:
            logger.warning("resuming at batch %d of epoch %d with %d processes (the run stopped with another "
                           "number): %d batch(es) before it are trained again, so the resume is not exact",
                           self.state.position, self.state.epoch, self.context.world_size, repeated)

    def checkpoint(self) -> dict[str, Any]:
        """A training checkpoint: the model's, plus what resuming needs (the schedule is a function
        of the update count and the training time, so it has no state of its own)."""
        state = dataclasses.replace(self.state, elapsed=self.elapsed())
        return model_state(self.model, self.config.arch, self.model_config, self.vocabs,
                           optimizer=self.optimizer.state_dict(), scaler=self.scaler.state_dict(),
                           rng=ckpt.rng_state(), train_state=dataclasses.asdict(state),
                           train_config=config_to_dict(self.config, self.model_config))

    def save(self, names: list[str]) -> None:
        if self.context.is_main and names:
            ckpt.write_checkpoints(self.save_dir, self.checkpoint(), names)
            ckpt.prune_checkpoints(self.save_dir, self.config.keep_last_epochs, self.config.keep_interval_updates)

    def elapsed(self) -> float:
        return self.elapsed_before + time.monotonic() - self.started

    # -- one update --------------------------------------------------------------------------------------

    def train_step(self, update: Update) -> StepResult:
        """Forward/backward over the update's batches and one optimizer step: this process's sums."""
        self.network.train()
        set_lr(self.scheduler, self.optimizer, self.state.update + 1, self.state.elapsed, self.state.warmup_elapsed)
        self.optimizer.zero_grad(set_to_none=True)
        scale = self.context.world_size / max(update.num_tokens, 1)  # DDP averages over processes; undo that
        sums = torch.zeros(4, device=self.device)
        twice = (lambda t: t.repeat(2, 1)) if self.config.rdrop_alpha else (lambda t: t)  # R-Drop: one batch twice
        try:
            for i, (batch, position) in enumerate(zip(update.batches, update.positions)):
                torch.manual_seed(batch_seed(self.config.seed, self.state.epoch, position))
                batch = batch.to(self.device)
                sync = i == len(update.batches) - 1 or not self.context.is_distributed
                with contextlib.nullcontext() if sync else self.network.no_sync():
                    with autocast(self.device, self.config.compute.precision):
                        states = self.network(twice(batch.source), twice(batch.prev_output), features_only=True)
                        loss, nll = label_smoothed_cross_entropy(
                            states, self.model.output_weight(), twice(batch.target), self.config.label_smoothing,
                            PAD_ID, self.config.rdrop_alpha)
                    self.scaler.scale(loss * scale).backward()
                sums += torch.stack([loss.detach(), nll.detach(), batch.target.ne(PAD_ID).sum().to(loss.dtype),
                                     torch.tensor(float(len(batch)), device=self.device)])
        except torch.cuda.OutOfMemoryError:
            self.skip_out_of_memory(update)
            return StepResult(0.0, 0.0, 0.0, 0.0, skipped="out of memory")
        result = StepResult(*sums.tolist())
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
                return dataclasses.replace(result, skipped="fp16 overflow")
        elif not math.isfinite(grad_norm):
            raise NmtError(f"the gradient norm became {grad_norm} at update {self.state.update + 1}; "
                           "lower --lr, raise --warmup-updates or set --clip-norm")
        else:
            self.optimizer.step()
        return dataclasses.replace(result, grad_norm=grad_norm)

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

    def agree(self, step: StepResult, interrupted: bool) -> tuple[StepResult, bool, float]:
        """Sum the step over all processes, and share the interrupt flag and the main process's training
        time (--max-time and the learning rate read it), so that every process acts alike."""
        elapsed = self.elapsed() if self.context.is_main else 0.0
        values = [step.loss, step.nll, step.tokens, step.sentences, float(interrupted), elapsed]
        loss, nll, tokens, sentences, interrupted, elapsed = all_reduce_sum(
            torch.tensor(values, dtype=torch.float64, device=self.device), self.context).tolist()
        return dataclasses.replace(step, loss=loss, nll=nll, tokens=tokens, sentences=sentences), bool(interrupted), \
            elapsed

    # -- after each update: validate, save, stop ---------------------------------------------------------

    def validate_and_save(self, stepped: bool, interrupted: bool = False, epoch_end: bool = False) -> str | None:
        """The one place that decides, after each update (``stepped``: it took an optimizer step) and at
        an epoch's end, whether to validate, what to save and whether to stop; returns why training stops.

        Validation comes at an epoch's end, every --validate-interval-updates and before a stop. A
        signal skips it and the epoch's end, to stop soon; the resume does them. The reason given is
        the first of stop_reason's that holds once the validation and the epoch's end are done.
        """
        config, state = self.config, self.state
        if interrupted:
            self.save(ckpt.checkpoint_names(config.save_interval_updates, state.epoch, state.update, stepped,
                                            stopping=True))
            return f"interrupted at update {state.update}: saved {LAST}; re-run the same command to resume"
        every = config.validate_interval_updates
        on_interval = stepped and every and state.update % every == 0
        improved = self.validate() if epoch_end or on_interval or stop_reason(config, state) else False
        finished = state.epoch
        if epoch_end:
            state.epoch, state.position = finished + 1, 0
        stop = stop_reason(config, state)  # --max-epoch counts the epoch just ended, --patience the validation
        self.save(ckpt.checkpoint_names(config.save_interval_updates, finished, state.update, stepped,
                                        improved=improved, epoch_end=epoch_end, stopping=stop is not None))
        return stop

    def validate(self) -> bool:
        """Validation loss (and BLEU with --eval-bleu) on each validation split; the first one's figures
        update the best loss and the patience count.

        Returns whether this validation is the best so far (it then goes into checkpoint_best.pt).
        """
        if not self.data.valid:
            return False
        self.model.eval()
        results = [(split.name, validation_figures(self.model, split, self.vocabs, self.config, self.device,
                                                   self.context)) for split in self.data.valid]
        self.last_valid = results[0][1]
        improved = record_validation(self.state, self.last_valid, self.config.best_checkpoint_metric)
        metric = self.config.best_checkpoint_metric
        best = (metric, self.state.best_valid_bleu if metric == "bleu" else self.state.best_valid_loss)
        for position, (name, figures) in enumerate(results):
            self.display.valid_line(name, self.state.epoch, self.state.update, figures, best if position == 0 else None)
        return improved

    # -- the loop --------------------------------------------------------------------------------------

    def fit(self) -> TrainSummary:
        config, state, context = self.config, self.state, self.context
        self.started, self.elapsed_before = time.monotonic(), state.elapsed
        counts = sorted(len(split.batches) for split in self.data.train)  # one a sampled segmentation
        shown = f"{counts[0]}" if counts[0] == counts[-1] else f"{counts[0]}-{counts[-1]}"
        logger.info("%s: %s parameters on %s (%s), %d process(es); %s training batches per epoch, "
                    "update = %d batch(es) x %d process(es); losses in nats per target token (fairseq logs base 2)",
                    config.arch, f"{count_parameters(self.model):,}", self.device, config.compute.precision,
                    context.world_size, shown, config.update_freq, context.world_size)
        left_out = max(batches_left_out(count, context.world_size) for count in counts)
        if left_out:
            amount = left_out if counts[0] == counts[-1] else f"up to {left_out}"
            logger.warning("%s training batches do not share evenly among %d processes: each epoch leaves out %s "
                           "of them (a different %s each epoch, as the order changes)", shown, context.world_size,
                           amount, amount)
        forecast = None  # the warm-up warning given at the start: the end does not repeat it
        if context.is_main:
            logger.info("precision: %s (%s)", config.compute.precision, self.precision_reason)
            per_epoch = -(-(round(sum(counts) / len(counts)) // context.world_size) // config.update_freq)
            if forecast := warmup_warning(config, per_epoch):
                logger.warning(forecast)
        run_meter = Meter()
        stop = None if self.epoch_end_owed() else stop_reason(config, state)  # an owed epoch end is done regardless
        if stop:  # config.yaml stays as the training wrote it: these options trained nothing
            logger.info("nothing to do: %s (a larger limit trains on from %s)", stop,
                        self.save_dir / LAST)
        elif context.is_main:
            write_config(self.save_dir / "config.yaml", config, self.model_config)
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
            tokens_per_second=figures["tokens_per_second"] if run_meter.tokens else 0.0,
            skipped_updates=run_meter.skipped)
        if interrupt.requested:
            raise Stopped(interrupt.signum, stop)  # the CLI's last line: where the run stopped, what was saved
        if context.is_main and not forecast and (warning := ended_in_warmup(config, state.update, stop)):
            logger.warning(warning)
        if context.is_main and logger.isEnabledFor(logging.INFO):
            rows = {"arch": config.arch, "epochs": summary.epoch, "updates": summary.updates,
                    "train loss (this run)": summary.train_loss,
                    "skipped updates (fp16 overflow)": summary.skipped_updates,
                    "valid loss": summary.valid_loss, "valid ppl": summary.valid_ppl,
                    **({"valid BLEU": summary.valid_bleu} if config.eval_bleu else {}),
                    "best valid loss": summary.best_valid_loss,
                    **({"best valid BLEU": state.best_valid_bleu} if config.best_checkpoint_metric == "bleu" else {}),
                    "target tokens/s": int(summary.tokens_per_second),
                    "wall clock": f"{summary.seconds:.1f} s", "stopped": summary.stop_reason,
                    "checkpoints": str(self.save_dir)}
            if log_state["format"] == "json":  # stderr stays pure JSON lines
                logger.info("training summary", extra={"fields": {"kind": "summary", **rows}})
            else:
                stderr_console.print(summary_table(rows))
        return summary

    def check_decoding(self) -> None:
        """Record in checkpoint_best.pt (what `nmt generate` and `nmt serve` decode by default) which
        faster decoding settings keep its BLEU on the first validation split."""
        path = self.save_dir / BEST
        if not self.data.valid or not path.exists():
            return
        checkpoint = load_checkpoint(path, mmap=True)  # its optimizer state is written back, not read
        if RECORD_KEY in checkpoint:  # checked since it was written: a re-run that had nothing to train
            return
        split = self.data.valid[0]
        sources, references = first_pairs(split.dataset, split.pairs.tolist(), None)  # pairs fit the model
        save_with_record(path, checkpoint, timed_check(checkpoint, sources, references, self.device, BEST,
                                                       self.config.check_search.search()))

    def epoch_end_owed(self) -> bool:
        """Whether the epoch's updates are all done but not its end (validation, its checkpoint): a
        signal on the epoch's last update stops before the end, which the resume then does first."""
        batches = len(self.data.for_epoch(self.state.epoch).batches)
        return self.state.position >= batches - batches_left_out(batches, self.context.world_size)

    def train_epoch(self, run_meter: Meter, interrupt: StopRequest) -> str | None:
        """Train from the current position through the epoch's end, or to a stop; the stop reason (None: go on)."""
        config, state, context = self.config, self.state, self.context
        split = self.data.for_epoch(state.epoch)
        epoch = EpochIterator(split.dataset, split.batches, seed=config.seed, epoch=state.epoch,
                              start=state.position, update_freq=config.update_freq, world_size=context.world_size,
                              rank=context.rank, prefetch=config.prefetch, pin_memory=self.device.type == "cuda")
        interval = Meter()
        total = epoch.num_updates()
        with self.display.epoch(state.epoch, total, total - epoch.num_updates(state.position)):
            if self.epoch_end_owed():
                return self.validate_and_save(stepped=False, epoch_end=True)
            for update in epoch:
                step = self.train_step(update)
                # Every process must agree to stop at the same update: the flag and the time travel with the sums.
                step, interrupted, state.elapsed = self.agree(step, interrupt.requested)
                state.position = update.position
                stepped = step.skipped is None
                state.update += stepped
                if stepped and state.update == config.warmup_updates:
                    state.warmup_elapsed = state.elapsed
                for meter in (interval, run_meter):
                    meter.add(step)
                lr = self.optimizer.param_groups[0]["lr"]
                self.display.advance(interval.figures(), lr)
                if stepped and state.update % config.log_interval == 0:
                    self.display.train_line(state.epoch, state.update, interval.figures(), lr)
                    interval = Meter()
                stop = self.validate_and_save(stepped, interrupted, epoch_end=update.position == epoch.num_batches)
                if stop:
                    return stop
        return None


def batches_left_out(num_batches: int, world_size: int) -> int:
    """Batches an epoch skips so that every process takes the same number (nmt/training/iterator.py)."""
    return num_batches % world_size


# What cuts an epoch into batches: a resume with other values sees another list of batches (a CPU's
# processes change --max-tokens with the threads: nmt/training/distributed.py).
BATCH_CUT = ("max_tokens", "max_sentences", "required_batch_size_multiple")


def batches_trained_again(position: int, world_size: int) -> int:
    """Batches a resume at ``position`` trains again: each process's shard starts at a multiple of
    the world size, so a position saved with another number of processes rounds down."""
    return position % world_size


def warmup_warning(config: TrainConfig, updates_per_epoch: int) -> str | None:
    """A warning when the run's update limits end it before its warm-up is half its length: the
    learning rate would spend most of the run (or all of it) climbing to a peak it barely holds.
    A time limit alone says nothing of the updates, so it is not judged here; a --warmup-share
    warm-up is a share of the run by its definition."""
    if config.warmup_share:
        return None
    limits = [(config.max_update, f"--max-update {config.max_update}")] if config.max_update else []
    if config.max_epoch:
        limits.append((config.max_epoch * updates_per_epoch,
                       f"--max-epoch {config.max_epoch} x {updates_per_epoch:,} updates per epoch"))
    if not limits:
        return None
    updates, why = min(limits)
    if updates >= 2 * config.warmup_updates:
        return None
    where = "inside" if updates <= config.warmup_updates else "just after"
    return (f"this run stops at {updates:,} updates ({why}), {where} its {config.warmup_updates:,}-update warm-up "
            f"(--warmup-updates): the learning rate {'never reaches' if where == 'inside' else 'barely holds'} its "
            f"peak; give about a tenth of the run, e.g. --warmup-updates {max(updates // 10, 1):,}, or more updates")


def ended_in_warmup(config: TrainConfig, updates: int, stop: str | None) -> str | None:
    """A warning when the run ended (by --max-time, say, which warmup_warning cannot foresee) before
    its --warmup-updates were done: its learning rate never reached its peak."""
    if config.warmup_share or updates >= config.warmup_updates:
        return None
    return (f"training ended at update {updates:,} ({stop}), inside its {config.warmup_updates:,}-update warm-up: "
            f"the learning rate never reached its peak; give more time, fewer --warmup-updates, or "
            f"--warmup-share with --lr-schedule cosine (a share of the budget)")


def stop_reason(config: TrainConfig, state: TrainState) -> str | None:
    """Why training stops now, or None to go on."""
    if config.max_update and state.update >= config.max_update:
        return f"reached --max-update {config.max_update}"
    if config.max_epoch and state.epoch > config.max_epoch:
        return f"reached --max-epoch {config.max_epoch}"
    if config.patience and state.bad_validations >= config.patience:
        return f"no better validation {config.best_checkpoint_metric} in {config.patience} validations (--patience)"
    if config.max_time is not None and state.elapsed >= config.max_time_seconds:
        return f"reached --max-time {config.max_time}"
    return None
