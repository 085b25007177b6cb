"""The training loop in-process: learning, exact resume, checkpoint files, fallbacks, stopping."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import shutil
import signal
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from conftest import MULTI30K, assert_same_weights, make_data_dir, make_trainer, numbers_pairs, tiny_config

from nmt.checkpoint.format import load_checkpoint, model_from_checkpoint, model_only
from nmt.data.dataset import DataDir, write_token_array
from nmt.data.meta import SplitMeta
from nmt.data.vocabulary import EOS_ID
from nmt.errors import NmtError, Stopped
from nmt.files import read_lines
from nmt.training import trainer as trainer_module
from nmt.training.distributed import StopRequest
from nmt.training.iterator import TrainingBatches
from nmt.training.trainer import train


def valid_losses(messages: list[str]) -> list[float]:
    return [float(re.search(r"\| loss ([\d.]+)", m)[1]) for m in messages if m.startswith("valid on")]


@pytest.mark.slow
def test_loss_goes_down(tiny_data_dir, tmp_path, messages):
    summary = train(tiny_config(tiny_data_dir, tmp_path, max_epoch=4))
    assert summary.epoch == 4 and summary.updates == 36 and summary.stop_reason == "reached --max-epoch 4"
    losses = valid_losses(messages)
    assert len(losses) == 4 and losses == sorted(losses, reverse=True)  # better after every epoch
    assert summary.valid_loss < 0.75 * math.log(120)  # log(vocabulary size): the loss of knowing nothing
    assert summary.best_valid_loss == summary.valid_loss
    model, vocabs = model_from_checkpoint(load_checkpoint(tmp_path / "checkpoint_best.pt"))
    assert vocabs.source_lang == "en" and model.config.d_model == 64  # loads like any checkpoint


@pytest.mark.slow
@pytest.mark.skipif(not MULTI30K.is_dir(), reason=f"Multi30k not found at {MULTI30K}")
def test_loss_goes_down_on_multi30k(tmp_path):
    # The 1014 validation pairs (900 to train on, 114 to validate): real language, a few seconds.
    pairs = list(zip(read_lines(MULTI30K / "val.en.gz"), read_lines(MULTI30K / "val.de.gz")))
    data = make_data_dir(tmp_path / "data", {"train": pairs[:900], "valid": pairs[900:]}, vocab_size=1000)
    options = {"max_tokens": 2000, "warmup_updates": 20}
    early = train(tiny_config(data, tmp_path / "run", max_update=10, **options))
    later = train(tiny_config(data, tmp_path / "run", max_update=40, **options))
    assert later.updates == 40 and later.valid_loss < early.valid_loss - 0.5, (early.valid_loss, later.valid_loss)


@pytest.mark.slow
def test_resumed_run_reaches_the_same_weights_bit_exactly(tiny_data_dir, tmp_path, messages):
    # 9 batches per epoch with update_freq 2: 5 updates per epoch (the last of one batch); stop at 3
    # (mid-epoch 1), 6 (one update into epoch 2) and 12 (two into epoch 3).
    options = {"update_freq": 2, "save_interval_updates": 2}
    straight = train(tiny_config(tiny_data_dir, tmp_path / "straight", max_update=12, **options))
    assert straight.updates == 12
    for max_update in (3, 6, 12):
        train(tiny_config(tiny_data_dir, tmp_path / "resumed", max_update=max_update, **options))
    assert "resuming from" in "\n".join(messages)
    assert_same_weights(tmp_path / "straight" / "checkpoint_last.pt", tmp_path / "resumed" / "checkpoint_last.pt")
    state = load_checkpoint(tmp_path / "resumed" / "checkpoint_last.pt")["train_state"]
    assert state["epoch"] == 3 and state["position"] == 4  # 2 updates of 2 batches into epoch 3


@pytest.mark.slow
def test_checkpoint_files_and_pruning(tiny_data_dir, tmp_path):
    train(tiny_config(tiny_data_dir, tmp_path, max_epoch=3, save_interval_updates=3, keep_last_epochs=2,
                      keep_interval_updates=2))
    names = sorted(path.name for path in tmp_path.iterdir())
    # 9 updates per epoch: interval saves at 3, 6, ..., 27 (epoch ends included); the newest 2 remain.
    assert names == ["checkpoint2.pt", "checkpoint3.pt", "checkpoint_3_24.pt", "checkpoint_3_27.pt",
                     "checkpoint_best.pt", "checkpoint_last.pt", "config.yaml", "metrics.jsonl"]
    last = load_checkpoint(tmp_path / "checkpoint_last.pt")
    assert last["train_state"]["epoch"] == 4 and last["train_state"]["position"] == 0
    assert last["train_config"]["train"]["max_epoch"] == 3 and last["train_config"]["model"]["d_model"] == 64
    assert set(last) >= {"optimizer", "scaler", "rng", "train_state", "train_config", "vocab"}
    assert load_checkpoint(tmp_path / "checkpoint_3_24.pt")["train_state"]["update"] == 24


def test_corrupt_last_checkpoint_falls_back_to_the_newest_that_loads(tiny_data_dir, tmp_path, messages):
    train(tiny_config(tiny_data_dir, tmp_path, max_update=6, save_interval_updates=2))
    last = tmp_path / "checkpoint_last.pt"
    last.write_bytes(last.read_bytes()[:1000])
    summary = train(tiny_config(tiny_data_dir, tmp_path, max_update=7, save_interval_updates=2))
    log = "\n".join(messages)
    assert "corrupt or not an nmt checkpoint" in log and "instead of the broken checkpoint_last.pt" in log
    assert summary.updates == 7  # resumed at 6, not started over
    assert load_checkpoint(last)["train_state"]["update"] == 7  # and checkpoint_last.pt is whole again


def test_nothing_loads_is_an_error_not_a_fresh_start(tiny_data_dir, tmp_path):
    (tmp_path / "checkpoint_last.pt").write_bytes(b"garbage")
    with pytest.raises(NmtError, match="does not load and no other checkpoint"):
        train(tiny_config(tiny_data_dir, tmp_path, max_update=1))


def test_restore_file_starts_from_a_model_only_checkpoint(tiny_data_dir, tmp_path, messages):
    train(tiny_config(tiny_data_dir, tmp_path / "first", max_update=4))
    checkpoint = load_checkpoint(tmp_path / "first" / "checkpoint_last.pt")
    assert set(checkpoint) - set(model_only(checkpoint)) >= {"optimizer", "train_state"}
    torch.save(model_only(checkpoint), tmp_path / "averaged.pt")
    summary = train(tiny_config(tiny_data_dir, tmp_path / "second", max_update=2,
                                restore_file=str(tmp_path / "averaged.pt")))
    assert summary.updates == 2 and "its weights only" in "\n".join(messages)
    with pytest.raises(NmtError, match="--restore-file not found"):
        train(tiny_config(tiny_data_dir, tmp_path / "third", restore_file="missing.pt"))


def test_resume_refuses_another_arch_or_vocabulary_but_not_another_dropout(tiny_data_dir, tmp_path, tmp_path_factory):
    train(tiny_config(tiny_data_dir, tmp_path, max_update=1))
    with pytest.raises(NmtError, match=r"does not match this run \(another --save-dir starts a new one\): different "
                       r"models \(transformer_tiny .* vs transformer_small .*d_model 64 vs 256.*; to resume it, give "
                       r"the checkpoint's --arch and --set$"):
        train(tiny_config(tiny_data_dir, tmp_path, arch="transformer_small"))
    with pytest.raises(NmtError, match=r"^--restore-file \S+checkpoint_last.pt does not match this run: different "
                       r"models .*; give the checkpoint's --arch and --set$"):
        train(tiny_config(tiny_data_dir, tmp_path / "new", arch="transformer_small",
                          restore_file=str(tmp_path / "checkpoint_last.pt")))
    resumed = train(tiny_config(tiny_data_dir, tmp_path, model={"dropout": "0.3"}, max_update=2))  # no weight
    assert resumed.updates == 2  # depends on a dropout: a resume (or a fine-tuning) may change it, as in fairseq
    assert load_checkpoint(tmp_path / "checkpoint_last.pt")["model_config"]["dropout"] == 0.3
    pairs = numbers_pairs(120, seed=5)
    other = make_data_dir(tmp_path_factory.mktemp("other-vocab"), {"train": pairs[:100], "valid": pairs[100:]},
                          vocab_size=120)
    with pytest.raises(NmtError, match="different source vocabularies$"):  # no --arch/--set could mend it
        train(tiny_config(other, tmp_path, max_update=2))


def test_patience_stops_and_validation_interval(tiny_data_dir, tmp_path, monkeypatch, messages):
    """--validate-interval-updates 2 validates at updates 2, 4, 6, 8 (before the epoch's end at 9);
    --patience 2 stops after two validations in a row without a lower loss. The losses are given, not
    trained for: a learning rate too small to learn moves the real loss by float rounding, down on
    some CPUs, and a loss lower by any amount restarts the patience."""
    from nmt.training import validation

    losses = itertools.chain([5.0, 4.0, 4.0], itertools.repeat(4.5))  # the third no lower, the fourth higher
    real = validation.validation_loss

    def given_loss(*args, **kwargs) -> dict[str, float]:
        return {**real(*args, **kwargs), "loss": next(losses)}

    monkeypatch.setattr(validation, "validation_loss", given_loss)
    summary = train(tiny_config(tiny_data_dir, tmp_path, validate_interval_updates=2, patience=2, max_epoch=5))
    assert summary.stop_reason == "no better validation loss in 2 validations (--patience)"
    assert summary.updates == 8 and summary.best_valid_loss == 4.0
    assert valid_losses(messages) == [5.0, 4.0, 4.0, 4.5]


def test_tensorboard_dir_without_tensorboard_is_a_clear_error(tiny_data_dir, tmp_path):
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(NmtError, match="needs the tensorboard package"):
            train(tiny_config(tiny_data_dir, tmp_path, max_update=1, tensorboard_dir=str(tmp_path / "tb")))
    else:
        train(tiny_config(tiny_data_dir, tmp_path, max_update=1, tensorboard_dir=str(tmp_path / "tb")))
        assert any((tmp_path / "tb").iterdir())


@pytest.mark.slow
def test_bf16_on_cpu_trains(tiny_data_dir, tmp_path):
    summary = train(tiny_config(tiny_data_dir, tmp_path, precision="bf16", max_update=8))
    assert summary.updates == 8 and math.isfinite(summary.valid_loss) and summary.valid_loss < math.log(120)


def test_out_of_memory_batches_are_skipped_then_fatal(tiny_data_dir, tmp_path, monkeypatch, messages):
    from nmt.models.transformer import Transformer

    forward = Transformer.forward
    calls = {"n": 0}

    def sometimes_out_of_memory(self, *args, **kwargs):
        calls["n"] += 1
        if self.training and calls["n"] == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", sometimes_out_of_memory)
    summary = train(tiny_config(tiny_data_dir, tmp_path / "once", max_update=4))
    assert summary.updates == 4 and any("out of memory at update 2" in m for m in messages)

    def always_out_of_memory(self, *args, **kwargs):
        if self.training:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", always_out_of_memory)
    with pytest.raises(NmtError, match="out of memory on 10 updates; lower --max-tokens"):
        train(tiny_config(tiny_data_dir, tmp_path / "always", max_update=4))


@pytest.mark.slow
def test_eval_bleu_reports_bleu_of_the_validation_set(tiny_data_dir, tmp_path, messages):
    from nmt.data.dataset import DataDir
    from nmt.generation.inference import TranslationRequest, prepare_model, translate_ids
    from nmt.generation.options import SearchOptions
    from nmt.scoring import MetricOptions, score

    summary = train(tiny_config(tiny_data_dir, tmp_path, max_epoch=3, eval_bleu=True, eval_bleu_beam=2))
    assert sum(" bleu " in m for m in messages if m.startswith("valid on")) == 3
    # The last validation's BLEU is that of the final weights' beam-2 translations of the valid
    # split against its target side, as `generate` would score them.
    model, vocabs = prepare_model(tmp_path / "checkpoint_last.pt", torch.device("cpu"))
    valid = DataDir.open(tiny_data_dir).split("valid")
    hypotheses = translate_ids(model, [valid.source[i] for i in range(len(valid))],
                               TranslationRequest(SearchOptions(beam=2)))
    expected = score([vocabs.target.decode(hyps[0].tokens) for hyps in hypotheses],
                     [[vocabs.target.decode(valid.target[i]) for i in range(len(valid))]],
                     options=MetricOptions(language="de"))[0].score
    assert summary.valid_bleu == pytest.approx(expected) and expected > 0


def test_eval_bleu_takes_the_tokenizer_case_and_target_language(tiny_data_dir, tmp_path, monkeypatch):
    from nmt import scoring
    from nmt.training import validation

    seen = []
    real_score = scoring.score
    monkeypatch.setattr(validation, "score", lambda *args, **kwargs: seen.append(kwargs["options"]) or
                        real_score(*args, **kwargs))
    config = tiny_config(tiny_data_dir, tmp_path, eval_bleu=True, eval_bleu_tokenize="char", eval_bleu_lowercase=True)
    make_trainer(config).validate()
    assert seen == [scoring.MetricOptions("char", lowercase=True, language="de")]
    with pytest.raises(NmtError, match="eval_bleu_tokenize must be one of auto, none, zh"):
        tiny_config(tiny_data_dir, tmp_path, eval_bleu_tokenize="moses")


def test_loss_scaler_skips_overflowing_steps(tiny_data_dir, tmp_path, messages):
    # fp16 autocast needs a GPU; the scaler logic is the same on CPU, so drive it with an inf gradient.
    from nmt.training.iterator import EpochIterator

    trainer = make_trainer(tiny_config(tiny_data_dir, tmp_path))
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    updates = iter(EpochIterator(trainer.data.train[0].dataset, trainer.data.train[0].batches, seed=1, epoch=1))
    weight = trainer.model.encoder_layers[0].ffn.fc1.weight
    handle = weight.register_hook(lambda grad: torch.full_like(grad, math.inf))
    before = weight.detach().clone()
    step = trainer.train_step(next(updates))
    assert step.skipped == "fp16 overflow" and step.grad_norm is None and torch.equal(weight, before)
    assert trainer.scaler.get_scale() == 512.0 and any("fp16 overflow at update 1" in m for m in messages)
    handle.remove()
    step = trainer.train_step(next(updates))
    assert step.skipped is None and math.isfinite(step.grad_norm) and not torch.equal(weight, before)


def test_after_each_update_one_place_decides_validating_saving_and_stopping(tiny_data_dir, tmp_path, monkeypatch):
    config = tiny_config(tiny_data_dir, tmp_path, max_update=8, max_epoch=2, save_interval_updates=2,
                         validate_interval_updates=3)
    trainer = make_trainer(config)
    validated, saved = [], []
    monkeypatch.setattr(trainer, "validate", lambda: validated.append(trainer.state.update) or len(validated) == 1)
    monkeypatch.setattr(trainer, "save", saved.append)

    def after(update: int, stepped: bool = True, **flags) -> tuple[bool, list[str], str | None]:
        """Whether update ``update`` validates, what it saves and why it stops."""
        trainer.state.update, validations = update, len(validated)
        stop = trainer.validate_and_save(stepped, **flags)
        return len(validated) > validations, saved.pop(), stop

    assert after(1) == (False, [], None)
    assert after(2) == (False, ["checkpoint_1_2.pt", "checkpoint_last.pt"], None)  # --save-interval-updates
    assert after(3) == (True, ["checkpoint_best.pt", "checkpoint_last.pt"], None)  # --validate-interval-updates, best
    assert after(4, stepped=False) == (False, [], None)  # a skipped step (fp16 overflow) is no update to count
    assert after(4, interrupted=True) == (False, ["checkpoint_1_4.pt", "checkpoint_last.pt"],
                                          "interrupted at update 4: saved checkpoint_last.pt; "
                                          "re-run the same command to resume")  # no validation: stop soon
    assert trainer.state.epoch == 1
    assert after(5, epoch_end=True) == (True, ["checkpoint1.pt", "checkpoint_last.pt"], None)
    assert (trainer.state.epoch, trainer.state.position) == (2, 0)
    assert after(6) == (True, ["checkpoint_2_6.pt", "checkpoint_last.pt"], None)
    assert after(8) == (True, ["checkpoint_2_8.pt", "checkpoint_last.pt"], "reached --max-update 8")  # validated
    trainer.config = dataclasses.replace(config, max_update=0)
    assert after(9, epoch_end=True) == (True, ["checkpoint2.pt", "checkpoint_last.pt"], "reached --max-epoch 2")
    trainer.config = dataclasses.replace(config, max_update=0, max_epoch=0, patience=1)
    monkeypatch.setattr(trainer, "validate",
                        lambda: validated.append(12) or setattr(trainer.state, "bad_validations", 1))
    assert after(12) == (True, ["checkpoint_3_12.pt", "checkpoint_last.pt"],
                         "no better validation loss in 1 validations (--patience)")  # decided after the validation


def test_max_positions_is_enforced_in_training(tiny_data_dir, tmp_path):
    with pytest.raises(NmtError, match="over the model's max_positions 8"):
        train(tiny_config(tiny_data_dir, tmp_path, max_update=1, model={"max_positions": 8}))


class StopAtUpdate(StopRequest):
    """Ctrl-C as the trainer sees it, arriving during update ``update`` (it asks once per update)."""

    def __init__(self, update: int, second_aborts: bool):
        super().__init__(second_aborts)
        self.asked, self.update = 0, update

    @property
    def requested(self) -> bool:
        self.asked += 1
        if self.asked >= self.update:
            self.signum = signal.SIGINT
        return self.signum is not None

    @requested.setter
    def requested(self, value: bool) -> None:
        raise AttributeError


@pytest.mark.slow
def test_a_stop_on_an_epochs_last_update_resumes_at_the_epochs_end(tiny_data_dir, tmp_path, monkeypatch):
    straight = train(tiny_config(tiny_data_dir, tmp_path / "straight", max_update=12))
    with monkeypatch.context() as patch:
        patch.setattr("nmt.training.trainer.StopRequest", lambda second_aborts: StopAtUpdate(9, second_aborts))
        with pytest.raises(Stopped):
            train(tiny_config(tiny_data_dir, tmp_path / "resumed", max_update=12))
    state = load_checkpoint(tmp_path / "resumed" / "checkpoint_last.pt")["train_state"]
    assert (state["epoch"], state["position"], state["update"]) == (1, 9, 9)  # 9 batches: the epoch's last
    resumed = train(tiny_config(tiny_data_dir, tmp_path / "resumed", max_update=12))
    assert resumed.updates == straight.updates == 12
    assert (tmp_path / "resumed" / "checkpoint1.pt").exists()  # the epoch's end the stop skipped
    assert_same_weights(tmp_path / "straight" / "checkpoint_last.pt", tmp_path / "resumed" / "checkpoint_last.pt")


def test_a_resume_takes_this_runs_optimizer_settings(tiny_data_dir, tmp_path, messages):
    train(tiny_config(tiny_data_dir, tmp_path, max_update=2))
    train(tiny_config(tiny_data_dir, tmp_path, max_update=3, adam_betas=(0.9, 0.999), adam_eps=1e-6, weight_decay=0.1))
    assert "changed: adam_betas" in "\n".join(messages)
    (group,) = load_checkpoint(tmp_path / "checkpoint_last.pt")["optimizer"]["param_groups"]
    assert (tuple(group["betas"]), group["eps"], group["weight_decay"]) == ((0.9, 0.999), 1e-6, 0.1)


def test_a_resume_with_batches_cut_otherwise_starts_the_epoch_again(tiny_data_dir, tmp_path, messages):
    """Position 4 of an epoch of 1,000-token batches is not position 4 of 500-token ones (a CPU's
    processes halve --max-tokens): the epoch starts again rather than leave pairs out."""
    train(tiny_config(tiny_data_dir, tmp_path, max_update=4))
    train(tiny_config(tiny_data_dir, tmp_path, max_update=5, max_tokens=500))
    assert "epoch 1 was cut into batches by max_tokens 1000, now by max_tokens 500: it starts again" in \
        "\n".join(messages)
    state = load_checkpoint(tmp_path / "checkpoint_last.pt")["train_state"]
    assert (state["epoch"], state["update"], state["position"]) == (1, 5, 1)
    train(tiny_config(tiny_data_dir, tmp_path, max_update=6, max_tokens=500))  # the same cut: on from batch 1
    state = load_checkpoint(tmp_path / "checkpoint_last.pt")["train_state"]
    assert (state["epoch"], state["update"], state["position"]) == (1, 6, 2)


def test_finetune_from_model_starts_a_new_run_from_the_weights(tiny_data_dir, tmp_path, messages):
    train(tiny_config(tiny_data_dir, tmp_path / "first", max_update=4))
    first = tmp_path / "first" / "checkpoint_last.pt"
    options = {"max_update": 2, "finetune_from_model": str(first)}
    summary = train(tiny_config(tiny_data_dir, tmp_path / "tuned", lr=1e-9, **options))
    assert summary.updates == 2 and "its weights only" in "\n".join(messages)
    state = load_checkpoint(tmp_path / "tuned" / "checkpoint_last.pt")
    # From update 0 at the epoch's start, not on from the first run's update 4 and batch 4.
    assert (state["train_state"]["update"], state["train_state"]["position"]) == (2, 2)
    weights = load_checkpoint(first)["model"]  # a learning rate of 1e-9: still the first run's weights
    assert all(torch.allclose(state["model"][name], tensor, atol=1e-6) for name, tensor in weights.items())
    with pytest.raises(NmtError, match="not both"):
        train(tiny_config(tiny_data_dir, tmp_path / "third", restore_file=str(first), **options))
    with pytest.raises(NmtError, match="--finetune-from-model not found: missing.pt"):
        train(tiny_config(tiny_data_dir, tmp_path / "third", finetune_from_model="missing.pt"))


@pytest.mark.slow
def test_the_skipped_epoch_end_is_done_even_when_the_stop_was_also_the_last_update(tiny_data_dir, tmp_path,
                                                                                   monkeypatch, messages):
    with monkeypatch.context() as patch:
        patch.setattr("nmt.training.trainer.StopRequest", lambda second_aborts: StopAtUpdate(9, second_aborts))
        with pytest.raises(Stopped):
            train(tiny_config(tiny_data_dir, tmp_path, max_update=9))
    assert not (tmp_path / "checkpoint1.pt").exists()
    summary = train(tiny_config(tiny_data_dir, tmp_path, max_update=9))
    assert summary.updates == 9 and summary.valid_loss is not None  # validated, not "nothing to do"
    assert (tmp_path / "checkpoint1.pt").exists() and (tmp_path / "checkpoint_best.pt").exists()
    assert not any(m.startswith("nothing to do") for m in messages)
    assert train(tiny_config(tiny_data_dir, tmp_path, max_update=9)).stop_reason == "reached --max-update 9"
    assert any(m.startswith("nothing to do") for m in messages)  # the third run: the epoch's end is done


def test_each_epoch_trains_on_the_next_sampled_segmentation_in_turn(tiny_data_dir, tmp_path, monkeypatch):
    data = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data)
    datadir = DataDir.open(data)
    vocab, train_split = datadir.vocabulary("en"), datadir.split("train")
    for number in (1, 2):  # what preprocess --subword-samples 2 writes beside train
        for lang, side in (("en", train_split.source), ("de", train_split.target)):
            spm.set_random_generator_seed(number)
            sampled = vocab.encode_batch([vocab.decode(side[i]) for i in range(len(side))], sampling_alpha=0.3)
            write_token_array(data / f"train.sample{number}.{lang}", [ids + [EOS_ID] for ids in sampled], len(vocab))
        datadir.meta.samples[f"train.sample{number}"] = SplitMeta(sentences=len(train_split))
    datadir.meta.save(data)
    read, iterator = [], trainer_module.EpochIterator

    def recording(dataset, *args, **kwargs):
        read.append(Path(dataset.source.prefix).name)
        return iterator(dataset, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "EpochIterator", recording)
    first = make_trainer(tiny_config(data, tmp_path / "checkpoints", max_epoch=1))
    best_segmentation = len(TrainingBatches(train_split, 1000))
    assert all(len(split.batches) > best_segmentation for split in first.data.train)  # more pieces, more batches
    first.fit()
    make_trainer(tiny_config(data, tmp_path / "checkpoints", max_epoch=3)).fit()  # resumed: epochs 2 and 3
    assert read == ["train.sample1.en", "train.sample2.en", "train.sample1.en"]
