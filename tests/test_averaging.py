import random
import subprocess

import pytest
import torch
from conftest import run_nmt

from nmt.checkpoint import averaging
from nmt.checkpoint.averaging import average, average_checkpoints, last_checkpoints
from nmt.checkpoint.format import Vocabularies, load_checkpoint, model_from_checkpoint, model_state, save_checkpoint
from nmt.checkpoint.options import AverageOptions
from nmt.data.vocabulary import PAD_ID, Vocabulary
from nmt.errors import NmtError
from nmt.models.registry import build_model, get_arch, resolve_config

WORDS = "the a cat dog sat on mat house tree red blue green big small runs jumps over under".split()


def train_vocab(words: list[str], seed: int) -> Vocabulary:
    rng = random.Random(seed)
    return Vocabulary.train([" ".join(rng.choice(words) for _ in range(8)) for _ in range(300)], vocab_size=60)


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return train_vocab(WORDS, 0)


def save_model(path, vocab, seed: int, arch_name: str = "transformer_tiny", **overrides):
    """A tiny model with seed-dependent weights, saved like a training checkpoint (plus optimizer junk)."""
    torch.manual_seed(seed)
    arch = get_arch(arch_name)
    config = resolve_config(arch.config, overrides)
    model = build_model(arch.model_name, config, len(vocab), len(vocab), PAD_ID)
    checkpoint = model_state(model, arch_name, config, Vocabularies("en", "de", vocab, vocab))
    checkpoint["optimizer"] = {"state": {0: {"step": torch.tensor(float(seed))}}}
    save_checkpoint(path, checkpoint)
    return model


def error_line(result: subprocess.CompletedProcess) -> str:
    """The CLI's one-line error (logs may precede it on stderr)."""
    assert result.returncode == 1 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and result.stderr.rstrip().endswith(errors[0]), result.stderr
    return errors[0]


def test_average_of_three_equals_the_hand_mean(tmp_path, vocab):
    models = [save_model(tmp_path / f"c{i}.pt", vocab, seed=i) for i in range(3)]
    averaged = average_checkpoints([tmp_path / f"c{i}.pt" for i in range(3)])
    states = [model.state_dict() for model in models]
    for key, tensor in averaged["model"].items():
        expected = (states[0][key].double() + states[1][key].double() + states[2][key].double()) / 3
        assert tensor.dtype == states[0][key].dtype
        torch.testing.assert_close(tensor, expected.to(tensor.dtype), rtol=0, atol=1e-7, msg=key)
    key = "encoder_layers.0.ffn.fc1.weight"
    assert not torch.equal(averaged["model"][key], states[2][key])
    assert "optimizer" not in averaged and averaged["averaged_from"] == [str(tmp_path / f"c{i}.pt") for i in range(3)]


def test_integer_buffers_come_from_the_last_checkpoint(tmp_path, vocab):
    paths = []
    for i in range(2):
        save_model(tmp_path / f"c{i}.pt", vocab, seed=i)
        checkpoint = load_checkpoint(tmp_path / f"c{i}.pt")
        checkpoint["model"]["steps"] = torch.tensor([10 * (i + 1)], dtype=torch.long)
        save_checkpoint(tmp_path / f"c{i}.pt", checkpoint)
        paths.append(tmp_path / f"c{i}.pt")
    averaged = average_checkpoints(paths)
    assert averaged["model"]["steps"].tolist() == [20] and averaged["model"]["steps"].dtype == torch.long


@pytest.mark.slow
def test_output_loads_rebuilds_and_keeps_tied_weights(tmp_path, vocab):
    for i in range(2):
        save_model(tmp_path / f"c{i}.pt", vocab, seed=i)
    output = tmp_path / "out" / "averaged.pt"
    result = run_nmt("average", "--inputs", tmp_path / "c0.pt", tmp_path / "c1.pt", "--output", output)
    assert result.returncode == 0, result.stderr
    checkpoint = load_checkpoint(output)
    assert checkpoint["arch"] == "transformer_tiny" and "optimizer" not in checkpoint
    state = checkpoint["model"]
    assert state["src_embed.weight"] is state["tgt_embed.weight"]
    model, vocabs = model_from_checkpoint(checkpoint)
    assert vocabs.source == vocab and model.src_embed.weight is model.tgt_embed.weight
    with torch.no_grad():
        logits = model.eval()(torch.tensor([[5, 6, 3]]), torch.tensor([[2, 7]]))
    assert logits.shape == (1, 2, len(vocab)) and torch.isfinite(logits).all()


def touch_checkpoints(directory, names):
    directory.mkdir(exist_ok=True)
    for name in names:
        (directory / name).write_bytes(b"")


def test_last_epoch_checkpoints_sort_by_number(tmp_path):
    names = [f"checkpoint{epoch}.pt" for epoch in (1, 2, 3, 9, 10, 11, 12, 100)]
    touch_checkpoints(tmp_path, names + ["checkpoint_last.pt", "checkpoint_best.pt", "checkpoint_12_5000.pt"])
    picked = last_checkpoints(tmp_path, num_epoch_checkpoints=5)
    assert [path.name for path in picked] == [f"checkpoint{e}.pt" for e in (9, 10, 11, 12, 100)]


def test_last_update_checkpoints_sort_by_update_number(tmp_path):
    updates = [(1, 900), (1, 1000), (2, 9000), (3, 10000), (3, 11000), (10, 100000)]
    touch_checkpoints(tmp_path, [f"checkpoint_{e}_{u}.pt" for e, u in updates] +
                      ["checkpoint_last.pt", "checkpoint_best.pt", "checkpoint99.pt"])
    picked = last_checkpoints(tmp_path, num_update_checkpoints=4)
    assert [path.name for path in picked] == ["checkpoint_2_9000.pt", "checkpoint_3_10000.pt",
                                              "checkpoint_3_11000.pt", "checkpoint_10_100000.pt"]


@pytest.mark.parametrize(("epochs", "share", "expected"), [(40, 0.1, [37, 38, 39, 40]), (12, 0.1, [12]),
                                                        (3, 0.1, [3]), (6, 1.0, [1, 2, 3, 4, 5, 6])])
def test_an_epoch_share_follows_the_runs_length(tmp_path, epochs, share, expected):
    """A tenth of a 40-epoch run (a fast machine) is 4 checkpoints, of a 12-epoch run 1.2 (rounded: 1)."""
    touch_checkpoints(tmp_path, [f"checkpoint{epoch}.pt" for epoch in range(1, epochs + 1)] + ["checkpoint_last.pt"])
    picked = last_checkpoints(tmp_path, epoch_share=share)
    assert [path.name for path in picked] == [f"checkpoint{epoch}.pt" for epoch in expected]


def test_an_epoch_share_needs_its_checkpoints_kept(tmp_path):
    touch_checkpoints(tmp_path, [f"checkpoint{epoch}.pt" for epoch in (48, 49, 50)])  # --keep-last-epochs 3
    with pytest.raises(NmtError, match=r"--epoch-share 0.1 of 50 epochs is the last 5 epoch checkpoints but .* 3"):
        last_checkpoints(tmp_path, epoch_share=0.1)
    with pytest.raises(NmtError, match="exactly one of"):
        last_checkpoints(tmp_path, num_epoch_checkpoints=2, epoch_share=0.1)


def test_too_few_checkpoints_is_an_error(tmp_path):
    touch_checkpoints(tmp_path, ["checkpoint1.pt", "checkpoint2.pt", "checkpoint_last.pt"])
    with pytest.raises(NmtError, match="last 3 epoch checkpoints but .* has 2"):
        last_checkpoints(tmp_path, num_epoch_checkpoints=3)


def test_selecting_from_a_save_dir_averages_the_right_files(tmp_path, vocab):
    save_dir = tmp_path / "run"
    for epoch in (8, 9, 10, 11):
        save_model(save_dir / f"checkpoint{epoch}.pt", vocab, seed=epoch)
    save_model(save_dir / "checkpoint_last.pt", vocab, seed=99)
    picked = average([save_dir], tmp_path / "avg.pt", num_epoch_checkpoints=2)
    assert [path.name for path in picked] == ["checkpoint10.pt", "checkpoint11.pt"]
    expected = average_checkpoints([save_dir / "checkpoint10.pt", save_dir / "checkpoint11.pt"])["model"]
    for key, tensor in load_checkpoint(tmp_path / "avg.pt")["model"].items():
        assert torch.equal(tensor, expected[key]), key


@pytest.mark.slow
def test_mismatched_arch_is_refused_on_one_line(tmp_path, vocab):
    save_model(tmp_path / "tiny.pt", vocab, seed=0)
    save_model(tmp_path / "wide.pt", vocab, seed=1, ffn_dim=256)
    result = run_nmt("average", tmp_path / "tiny.pt", tmp_path / "wide.pt", "-o", tmp_path / "out.pt")
    message = error_line(result)
    assert message.startswith("error: cannot average")
    assert "tiny.pt" in message and "wide.pt" in message
    assert message.index("tiny.pt") < message.index("wide.pt") and "ffn_dim 128 vs 256" in message  # in that order
    assert not (tmp_path / "out.pt").exists()


def test_mismatched_vocabulary_is_refused(tmp_path, vocab):
    save_model(tmp_path / "a.pt", vocab, seed=0)
    save_model(tmp_path / "b.pt", train_vocab(WORDS[::-1] + ["zebra", "yak"], seed=1), seed=1)
    with pytest.raises(NmtError, match=r"cannot average .*a\.pt and .*b\.pt: different source vocabularies"):
        average([tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_truncated_input_is_reported(tmp_path, vocab):
    save_model(tmp_path / "a.pt", vocab, seed=0)
    save_model(tmp_path / "b.pt", vocab, seed=1)
    data = (tmp_path / "b.pt").read_bytes()
    (tmp_path / "b.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(NmtError, match=r"b\.pt is corrupt or not an nmt checkpoint"):
        average([tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_an_output_directory_fails_before_the_checkpoints_are_read(tmp_path, vocab, monkeypatch):
    save_model(tmp_path / "a.pt", vocab, seed=0)
    (tmp_path / "out").mkdir()
    monkeypatch.setattr(averaging, "load_checkpoint", lambda *args, **kwargs: pytest.fail("read a checkpoint"))
    with pytest.raises(NmtError, match=r"cannot write \S*out: it is a directory"):
        average([tmp_path / "a.pt"], tmp_path / "out")


def test_bad_input_combinations_are_clear_errors(tmp_path, vocab):
    save_model(tmp_path / "a.pt", vocab, seed=0)
    with pytest.raises(NmtError, match="is a directory"):
        average([tmp_path], tmp_path / "out.pt")
    with pytest.raises(NmtError, match="exactly one save dir"):
        average([tmp_path / "a.pt"], tmp_path / "out.pt", num_epoch_checkpoints=1)
    with pytest.raises(NmtError, match=r"exactly one save dir as input, got \S*missing \(no such directory\)"):
        average([tmp_path / "missing"], tmp_path / "out.pt", num_epoch_checkpoints=1)
    before = (tmp_path / "a.pt").read_bytes()
    (tmp_path / "link.pt").symlink_to(tmp_path / "a.pt")
    with pytest.raises(NmtError, match="--output .*link.pt is also the input"):
        average([tmp_path / "a.pt"], tmp_path / "link.pt")
    run, fresh = tmp_path / "run", tmp_path / "fresh"  # a save dir, and one a recipe's training will make
    run.mkdir()
    save_model(run / "checkpoint_last.pt", vocab, seed=2)
    for name in ("checkpoint_last.pt", "checkpoint_best.pt", "checkpoint3.pt", "checkpoint_1_50.pt"):
        with pytest.raises(NmtError, match="has the name of a training checkpoint"):
            average([tmp_path / "a.pt"], run / name)
        with pytest.raises(NmtError, match="has the name of a training checkpoint"):
            AverageOptions([str(fresh)], str(fresh / name), num_epoch_checkpoints=1)
    assert (tmp_path / "a.pt").read_bytes() == before and [p.name for p in run.iterdir()] == ["checkpoint_last.pt"]
    average([tmp_path / "a.pt"], tmp_path / "deploy" / "checkpoint_best.pt")  # outside a save dir: any name
    with pytest.raises(NmtError, match="exactly one of"):
        last_checkpoints(tmp_path, num_epoch_checkpoints=1, num_update_checkpoints=1)
    with pytest.raises(NmtError, match="given twice"):
        average_checkpoints([tmp_path / "a.pt", tmp_path / "." / "a.pt"])
    with pytest.raises(NmtError, match="not found"):
        average_checkpoints([tmp_path / "a.pt", tmp_path / "missing.pt"])
