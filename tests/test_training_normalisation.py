"""What the reported and applied numbers rest on: loss normalisation over the whole update, the
learning rate of the update being taken, skipped steps kept out of the loss, honest log notes."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_trainer, tiny_config

from nmt.checkpoint.format import load_checkpoint
from nmt.data.batching import Batch
from nmt.data.vocabulary import PAD_ID
from nmt.training.iterator import EpochIterator, Update
from nmt.training.progress import Meter, StepResult
from nmt.training.trainer import Trainer, batches_left_out, batches_trained_again, train

NO_DROPOUT = {"dropout": "0", "attention_dropout": "0", "activation_dropout": "0"}


def trainer_for(data_dir, save_dir, **options) -> Trainer:
    config = tiny_config(data_dir, save_dir, **options)
    config.model = NO_DROPOUT
    return make_trainer(config)


def gradients_of_one_step(trainer: Trainer, update: Update) -> list[torch.Tensor]:
    """Run train_step and keep the gradients the optimizer is about to apply."""
    captured = []
    trainer.optimizer.step = lambda: captured.extend(p.grad.clone() for p in trainer.model.parameters())
    trainer.train_step(update)
    assert len(captured) == len(list(trainer.model.parameters())) > 0, "train_step did not step the optimizer once"
    return captured


def merged(batches: list[Batch]) -> Batch:
    """One batch holding the sentences of several (padded to the longest)."""
    def stack(tensors):
        width = max(t.size(1) for t in tensors)
        return torch.cat([torch.nn.functional.pad(t, (0, width - t.size(1)), value=PAD_ID) for t in tensors])
    return Batch(torch.cat([b.indices for b in batches]), stack([b.source for b in batches]),
                 stack([b.prev_output for b in batches]), stack([b.target for b in batches]))


def test_update_freq_2_takes_the_gradient_of_the_two_batches_merged(tiny_data_dir, tmp_path):
    accumulating = trainer_for(tiny_data_dir, tmp_path / "a", update_freq=2)
    split = accumulating.data.train[0]
    update = next(iter(EpochIterator(split.dataset, split.batches, seed=1, epoch=1, update_freq=2)))
    tokens = [int(b.target.ne(PAD_ID).sum()) for b in update.batches]
    assert len(update.batches) == 2 and tokens[0] != tokens[1]  # per-batch normalisation would differ
    accumulated = gradients_of_one_step(accumulating, update)

    single = trainer_for(tiny_data_dir, tmp_path / "b")  # the same seed: the same initial weights
    one_batch = Update([merged(update.batches)], update.positions[:1], update.num_tokens, update.position)
    together = gradients_of_one_step(single, one_batch)
    for a, b in zip(accumulated, together):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_each_update_uses_the_schedules_learning_rate_for_its_number(tiny_data_dir, tmp_path):
    trainer = trainer_for(tiny_data_dir, tmp_path, warmup_updates=4)
    applied = []
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda: (applied.append(trainer.optimizer.param_groups[0]["lr"]), step())
    updates = iter(EpochIterator(trainer.data.train[0].dataset, trainer.data.train[0].batches, seed=1, epoch=1))
    for _ in range(6):
        trainer.train_step(next(updates))
        trainer.state.update += 1
    assert applied == [trainer.scheduler.lr_at(n) for n in range(1, 7)]
    assert applied[0] < applied[3] > applied[5]  # warm-up, then decay: the update count, not a constant


def test_skipped_steps_are_counted_apart_and_kept_out_of_the_loss():
    meter = Meter()
    meter.add(StepResult(loss=20.0, nll=10.0, tokens=10.0, sentences=2.0, grad_norm=1.0))
    meter.add(StepResult(loss=1e6, nll=1e6, tokens=10.0, sentences=2.0, skipped="fp16 overflow"))
    figures = meter.figures()
    assert figures["loss"] == 2.0 and figures["nll"] == 1.0 and figures["skipped"] == 1 and meter.updates == 1


def test_fp16_overflow_steps_are_left_out_of_the_run_loss(tiny_data_dir, tmp_path, monkeypatch):
    """A run whose every other step overflows reports the loss of the steps taken, and their count."""
    trainer = trainer_for(tiny_data_dir, tmp_path, max_update=3)
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    calls = {"n": 0}
    train_step = trainer.train_step

    def overflow_every_other(update):
        calls["n"] += 1
        if calls["n"] % 2 == 0:
            weight = trainer.model.encoder_layers[0].ffn.fc1.weight
            handle = weight.register_hook(lambda grad: torch.full_like(grad, math.inf))
            try:
                return train_step(update)
            finally:
                handle.remove()
        return train_step(update)

    monkeypatch.setattr(trainer, "train_step", overflow_every_other)
    summary = trainer.fit()
    assert summary.updates == 3 and summary.skipped_updates == 2 and calls["n"] == 5


def test_uneven_shares_and_inexact_resumes_are_counted():
    assert batches_left_out(9, 2) == 1 and batches_left_out(9, 3) == 0 and batches_left_out(5, 1) == 0
    assert batches_trained_again(6, 4) == 2 and batches_trained_again(8, 4) == 0 and batches_trained_again(7, 1) == 0


def test_the_log_says_losses_are_in_nats(tiny_data_dir, tmp_path, messages):
    train(tiny_config(tiny_data_dir, tmp_path, max_update=1))
    assert any("losses in nats per target token (fairseq logs base 2)" in m for m in messages)


def test_a_time_budgeted_decay_follows_the_training_time_every_process_agrees_on(tiny_data_dir, tmp_path,
                                                                                  monkeypatch):
    """--lr-schedule linear with --max-time: each update's rate comes from the training time agreed
    after the update before (25 s of a 100 s budget per update here), counted from the end of the
    one-update warm-up, and the run ends annealed."""
    clock = {"seconds": 0.0}
    monkeypatch.setattr(Trainer, "elapsed", lambda self: clock["seconds"])
    applied = []
    step = torch.optim.AdamW.step

    def timed_step(self, *args, **kwargs):
        applied.append(self.param_groups[0]["lr"])
        clock["seconds"] += 25.0
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", timed_step)
    summary = train(tiny_config(tiny_data_dir, tmp_path, lr_schedule="linear", warmup_updates=1, lr=1e-3,
                                max_time="100s", valid_subset=None))
    assert summary.updates == 4
    assert applied == [pytest.approx(1e-3 * share) for share in (1.0, 1.0, 2 / 3, 1 / 3)]


def test_saving_keeps_the_agreed_training_time_and_the_checkpoint_has_the_own_clock(tiny_data_dir, tmp_path,
                                                                                    monkeypatch):
    """Every process's learning rate reads state.elapsed, the main process's time as agree() shared it:
    a save must not put a process's own clock there (DDP replicas would drift apart)."""
    trainer = trainer_for(tiny_data_dir, tmp_path)
    monkeypatch.setattr(Trainer, "elapsed", lambda self: 99.0)
    trainer.state.elapsed = 50.0
    trainer.save(["checkpoint_last.pt"])
    assert trainer.state.elapsed == 50.0
    assert load_checkpoint(trainer.save_dir / "checkpoint_last.pt")["train_state"]["elapsed"] == 99.0


def test_rdrop_without_dropout_takes_the_plain_gradient_of_each_token_once(tiny_data_dir, tmp_path):
    """R-Drop's two passes of a batch, without dropout, are the same: no divergence, and the loss per
    target token (so the gradient) is the plain one, not twice it."""
    plain = trainer_for(tiny_data_dir, tmp_path / "plain")
    update = next(iter(EpochIterator(plain.data.train[0].dataset, plain.data.train[0].batches, seed=1, epoch=1)))
    expected = gradients_of_one_step(plain, update)
    rdrop = trainer_for(tiny_data_dir, tmp_path / "rdrop", rdrop_alpha=5.0)
    for a, b in zip(gradients_of_one_step(rdrop, update), expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
