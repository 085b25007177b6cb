import pytest
import torch

from nmt.checkpoint.format import Vocabularies, load_checkpoint, model_from_checkpoint, model_state, save_checkpoint
from nmt.checkpoint.names import found_member_dirs, member_dirs
from nmt.data.vocabulary import PAD_ID, Vocabulary
from nmt.errors import NmtError
from nmt.models.registry import build_model, get_arch, resolve_config

WORDS = "the a cat dog sat on mat house tree red blue green big small runs jumps over under".split()


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    import random

    rng = random.Random(0)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(300)]
    return Vocabulary.train(sentences, vocab_size=60)


@pytest.fixture()
def checkpoint_path(tmp_path, vocab):
    torch.manual_seed(0)
    arch = get_arch("transformer_tiny")
    model = build_model(arch.model_name, arch.config, len(vocab), len(vocab), PAD_ID)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model_state(model, "transformer_tiny", arch.config, Vocabularies("en", "de", vocab, vocab)))
    return path, model


def test_model_rebuilds_from_the_checkpoint_alone(checkpoint_path, vocab):
    path, original = checkpoint_path
    model, vocabs = model_from_checkpoint(load_checkpoint(path))
    assert vocabs.joint and vocabs.source == vocab and vocabs.source_lang == "en"
    assert model.src_embed.weight is model.tgt_embed.weight  # tying survives a reload
    for (name, a), (_, b) in zip(original.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name


def test_truncated_checkpoint_is_reported(checkpoint_path, tmp_path):
    path, _ = checkpoint_path
    data = path.read_bytes()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(NmtError, match="corrupt or not an nmt checkpoint"):
        load_checkpoint(truncated)


def test_garbage_and_foreign_files_are_reported(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00not a checkpoint" * 10)
    with pytest.raises(NmtError, match="corrupt or not an nmt checkpoint"):
        load_checkpoint(garbage)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(2)}, foreign)
    with pytest.raises(NmtError, match="not an nmt checkpoint"):
        load_checkpoint(foreign)
    with pytest.raises(NmtError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")


def test_weights_of_another_shape_are_reported(checkpoint_path):
    path, _ = checkpoint_path
    checkpoint = load_checkpoint(path)
    checkpoint["model_config"] = {**checkpoint["model_config"], "ffn_dim": 256}
    with pytest.raises(NmtError, match="do not match"):
        model_from_checkpoint(checkpoint)


def test_save_is_atomic_and_leaves_no_temp_files(checkpoint_path):
    path, _ = checkpoint_path
    before = path.read_bytes()

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        save_checkpoint(path, {"bad": Unpicklable()})
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_resolved_overrides_are_stored(tmp_path, vocab):
    arch = get_arch("transformer_tiny")
    config = resolve_config(arch.config, {"dropout": "0.25"})
    model = build_model(arch.model_name, config, len(vocab), len(vocab), PAD_ID)
    path = tmp_path / "c.pt"
    save_checkpoint(path, model_state(model, "transformer_tiny", config, Vocabularies("en", "de", vocab, vocab)))
    rebuilt, _ = model_from_checkpoint(load_checkpoint(path))
    assert rebuilt.config.dropout == 0.25


def test_flipped_bytes_are_caught_by_the_checksum_and_old_checkpoints_still_load(checkpoint_path, tmp_path):
    path, _ = checkpoint_path
    for entry in ("model", "vocab"):
        checkpoint = torch.load(path, weights_only=True)  # the raw dict, checksums included
        if entry == "model":
            next(iter(checkpoint["model"].values())).view(-1)[:10] += 1.0
        else:
            proto = bytearray(checkpoint["vocab"]["source"])
            proto[100] ^= 0xFF
            checkpoint["vocab"]["source"] = bytes(proto)
        damaged = tmp_path / f"damaged-{entry}.pt"
        torch.save(checkpoint, damaged)  # a valid file whose bytes no longer match its checksums
        with pytest.raises(NmtError, match=f"is corrupt: its '{entry}' entry does not match its checksum"):
            load_checkpoint(damaged)
    old = torch.load(path, weights_only=True)
    del old["checksums"]  # as written before checksums existed
    torch.save(old, tmp_path / "old.pt")
    assert set(load_checkpoint(tmp_path / "old.pt")) == set(old)


def test_a_signal_during_the_write_acts_after_it(tmp_path, monkeypatch):
    """A Ctrl-C that arrives inside torch.save reaches its handler once the checkpoint is whole.

    Stopped in its Python callback, torch's zip writer would write its end to the closed file when
    collected and abort the process (a second Ctrl-C in training).
    """
    import os
    import signal

    import torch

    from nmt.checkpoint.format import save_checkpoint
    from nmt.errors import Stopped

    real_save = torch.save

    def save_with_a_signal(obj, handle):
        os.kill(os.getpid(), signal.SIGINT)  # a handler that is not held would raise here
        real_save(obj, handle)

    def stop(signum, frame):
        raise Stopped(signum, "stopped at once")

    monkeypatch.setattr(torch, "save", save_with_a_signal)
    previous = signal.signal(signal.SIGINT, stop)
    try:
        with pytest.raises(Stopped):
            save_checkpoint(tmp_path / "checkpoint_last.pt", {"model": {"w": torch.ones(3)}})
        assert signal.getsignal(signal.SIGINT) is stop  # the handler is back
    finally:
        signal.signal(signal.SIGINT, previous)
    assert [path.name for path in tmp_path.iterdir()] == ["checkpoint_last.pt"]  # whole, no temp file left
    assert torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)["model"]["w"].tolist() == [1.0, 1.0, 1.0]


def test_a_write_that_fails_while_a_signal_waits_says_why_before_the_signal_acts(tmp_path, monkeypatch, caplog):
    """Disk full during a save with a Ctrl-C held: the error is logged, then the Ctrl-C ends the command
    (it would otherwise hide the error behind "interrupted")."""
    import errno
    import os
    import signal

    import torch

    from nmt.checkpoint.format import save_checkpoint
    from nmt.errors import Stopped
    from nmt.log import logger

    def full_disk(obj, handle):
        os.kill(os.getpid(), signal.SIGINT)
        raise OSError(errno.ENOSPC, "No space left on device")

    def stop(signum, frame):
        raise Stopped(signum, "stopped at once")

    monkeypatch.setattr(torch, "save", full_disk)
    monkeypatch.setattr(logger, "propagate", True)  # the CLI's logging set-up turns it off; caplog listens at root
    previous = signal.signal(signal.SIGINT, stop)
    try:
        with pytest.raises(Stopped):
            save_checkpoint(tmp_path / "checkpoint_last.pt", {"model": {"w": torch.ones(3)}})
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "No space left on device" in caplog.text
    assert list(tmp_path.iterdir()) == []  # no half-written checkpoint


def test_the_model_directories_found_are_those_member_dirs_names(tmp_path):
    for directory in member_dirs(tmp_path, 11):
        directory.mkdir()
    for other in ("model0", "model", "model1x", "modelling"):
        (tmp_path / other).mkdir()
    (tmp_path / "model12").write_text("a file, not a model's directory")
    assert found_member_dirs(tmp_path) == member_dirs(tmp_path, 11)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "model13").symlink_to(tmp_path / "elsewhere")  # training would write through it
    assert found_member_dirs(tmp_path) == [*member_dirs(tmp_path, 11), tmp_path / "model13"]
