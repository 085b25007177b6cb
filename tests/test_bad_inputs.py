"""The catalogue of bad inputs and faults: every subcommand, through the real CLI (nmt.cli.main).

Each case sets up its fault in a shared working directory (a data directory, a trained save dir,
checkpoints, raw text, earlier good outputs), runs one command there and asserts what a user must
always get: exit code != 0, exactly one ``error:`` line on stderr, no traceback, nothing on
stdout, and no file of the working directory created, changed or removed (so no partial output,
and earlier good outputs unchanged). docs/reliability.md lists the cases with the message each
gets. Faults that need a read-only or full filesystem mount a small tmpfs, which needs root (and
a kernel that lets this process mount); elsewhere they skip and say so.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from conftest import make_data_dir, numbers_pairs

from nmt.checkpoint.format import load_checkpoint, save_checkpoint
from nmt.cli import main
from nmt.models.registry import build_model, get_arch, resolve_config

TRAIN = ["train", "data", "--arch", "transformer_tiny", "--max-tokens", "1000", "-q"]
RUN_CONFIG = "arch: transformer_tiny\nmodel: {}\ntrain: {save_dir: run}\n"  # a save dir's, as nmt's training writes it
GENERATE = ["generate", "data", "--path", "model.pt", "-q"]
RAW = ["generate", "--path", "model.pt", "-q", "-i"]
DISK_FULL_RUN = [*TRAIN, "--save-dir", "small/ck", "--max-update", "1"]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """The working directory every case runs in, with good inputs and earlier good outputs."""
    from nmt.training.config import load_train_config
    from nmt.training.trainer import train

    root = tmp_path_factory.mktemp("world")
    pairs = numbers_pairs(140, seed=0)
    make_data_dir(root / "data", {"train": pairs[:100], "valid": pairs[100:120], "test": pairs[120:]})
    other = numbers_pairs(140, seed=7)
    make_data_dir(root / "other-data", {"train": other[:100], "valid": other[100:120]}, vocab_size=100)
    train(load_train_config({"data": str(root / "data"), "arch": "transformer_tiny", "save_dir": str(root / "run"),
                             "max_tokens": 1000, "max_update": 2, "save_interval_updates": 1, "lr": 1e-3,
                             "warmup_updates": 2}))
    (root / "model.pt").write_bytes((root / "run" / "checkpoint_last.pt").read_bytes())
    raw = root / "raw"
    raw.mkdir()
    for split, part in (("train", pairs[:100]), ("valid", pairs[100:120])):
        for lang, side in (("en", 0), ("de", 1)):
            (raw / f"{split}.{lang}").write_text("".join(pair[side] + "\n" for pair in part), encoding="utf-8")
    (root / "text.en").write_text("".join(pair[0] + "\n" for pair in pairs[120:]), encoding="utf-8")
    (root / "text.de").write_text("".join(pair[1] + "\n" for pair in pairs[120:]), encoding="utf-8")
    (root / "good.hyp").write_text("an earlier good translation\n", encoding="utf-8")
    return root


def write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def checkpoint_with(world: Path, name: str, change: Callable[[dict], None]) -> None:
    """A copy of model.pt with one thing changed (saved with a valid checksum)."""
    checkpoint = load_checkpoint(world / "model.pt")
    change(checkpoint)
    save_checkpoint(world / name, checkpoint)


def other_arch(checkpoint: dict) -> None:
    arch = get_arch("transformer_tiny")
    config = resolve_config(arch.config, {"ffn_dim": 256})
    model = build_model(arch.model_name, config, 120, 120, 0)
    checkpoint["model_config"]["ffn_dim"] = 256
    checkpoint["model"] = model.state_dict()


def other_vocab(world: Path) -> Callable[[dict], None]:
    def change(checkpoint: dict) -> None:
        proto = (world / "other-data" / "spm.model").read_bytes()
        checkpoint["vocab"] = {**checkpoint["vocab"], "source": proto, "target": proto}
    return change


def flip_tensor_bytes(world: Path) -> None:
    """Flip bytes inside the stored weights, leaving the zip structure valid (torch.load accepts it)."""
    checkpoint = torch.load(world / "model.pt", weights_only=True)
    weight = next(iter(checkpoint["model"].values()))
    weight.view(-1)[:50] += 1.0
    torch.save(checkpoint, world / "flipped.pt")  # the stored checksums are now wrong


def mount_tmpfs(path: Path, options: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if os.path.ismount(path):
        return
    if os.geteuid() != 0:
        pytest.skip("a read-only or full filesystem needs a tmpfs mount, which needs root")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")


def read_only(world: Path) -> None:
    mount_tmpfs(world / "ro", "size=1m,ro")


def full_disk(world: Path) -> None:
    """A 64 KiB tmpfs filled to the last byte."""
    mount_tmpfs(world / "full", "size=64k")
    with contextlib.suppress(OSError), open(world / "full" / "filler", "ab") as handle:
        while True:
            handle.write(b"\0" * 4096)
            handle.flush()


def invoke(world: Path, args: list[str]) -> None:
    """Run a command in the world directory for its side effects (output is discarded by the test)."""
    cwd, argv = os.getcwd(), sys.argv
    os.chdir(world)
    sys.argv = ["nmt", *args]
    try:
        main()
    except SystemExit:
        pass
    finally:
        os.chdir(cwd)
        sys.argv = argv


def separate_vocabularies(world: Path) -> None:
    if not (world / "sep-data").exists():
        invoke(world, ["preprocess", "-s", "en", "-t", "de", "--trainpref", "raw/train", "--validpref", "raw/valid",
                       "--destdir", "sep-data", "--vocab-size", "60", "--no-byte-fallback", "--no-joint", "-q"])


def corrupt_gzip(world: Path) -> None:
    """A .gz whose deflate stream is damaged (its header intact): zlib, not gzip's CRC, finds it."""
    data = bytearray(gzip.compress((TEXT * 50).encode(), mtime=0))
    data[10] ^= 0xFF  # the first byte of the deflate stream: "invalid code lengths set"
    write(world / "bad" / "zlib.en.gz", bytes(data))
    write(world / "bad" / "zlib.de", TEXT * 50)


def save_dir_on_a_small_disk(world: Path) -> None:
    """A 1 MiB filesystem: room for the run's config.yaml (written by a first attempt), not for a checkpoint."""
    mount_tmpfs(world / "small", "size=1m")
    if not (world / "small" / "ck" / "config.yaml").exists():
        invoke(world, DISK_FULL_RUN)


def planted_symlink(name: str, target: str) -> Callable[[Path], None]:
    """A symlink owned by another user (uid 65534, nobody), as anyone can plant one in /tmp."""
    def plant(world: Path) -> None:
        if os.geteuid() != 0:
            pytest.skip("a symlink owned by another user needs root to make (lchown)")
        link = world / name
        if not link.is_symlink():
            link.symlink_to(world / target)
        os.lchown(link, 65534, 65534)
    return plant


_lock_holders: list[subprocess.Popen] = []


def locked_by_another_run(world: Path) -> None:
    """Another process holds the lock of save dir ``busy`` (as a running `nmt train` does)."""
    (world / "busy").mkdir(exist_ok=True)
    code = ("import sys, time; from pathlib import Path; from nmt.files import lock_directory; "
            "lock_directory(Path(sys.argv[1])); print('locked', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(world / "busy")], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert holder.stdout.readline().strip() == "locked"
    _lock_holders.append(holder)


@pytest.fixture(scope="module", autouse=True)
def cleanup(world):
    yield
    for holder in _lock_holders:
        holder.kill()
        holder.wait()
    for mount in ("ro", "full", "small"):
        if os.path.ismount(world / mount):
            subprocess.run(["umount", "--lazy", str(world / mount)], check=False)  # this process may hold a lock there


def setup(files: dict[str, bytes | str] | None = None, then: Callable[[Path], None] | None = None):
    def prepare(world: Path) -> None:
        for name, data in (files or {}).items():
            write(world / name, data)
        if then is not None:
            then(world)
    return prepare


NO_SETUP = setup()
TEXT = "one two three\n"

# (case id, arguments, text the error line must contain, setup)
CASES = [
    # preprocess
    ("preprocess-missing-files", ["preprocess", "-s", "en", "-t", "de", "--trainpref", "nowhere/train",
                                  "--destdir", "out-data"], "not found", NO_SETUP),
    ("preprocess-empty-file", ["preprocess", "-s", "en", "-t", "de", "--trainpref", "bad/empty",
                               "--destdir", "out-data"], "empty", setup({"bad/empty.en": "", "bad/empty.de": ""})),
    ("preprocess-line-counts", ["preprocess", "-s", "en", "-t", "de", "--trainpref", "bad/counts",
                                "--destdir", "out-data", "--vocab-size", "20", "--no-byte-fallback"], "lines",
     setup({"bad/counts.en": TEXT * 3, "bad/counts.de": TEXT * 2})),
    ("preprocess-bad-utf8", ["preprocess", "-s", "en", "-t", "de", "--trainpref", "bad/latin1",
                             "--destdir", "out-data"], "not valid UTF-8",
     setup({"bad/latin1.en": TEXT.encode() + b"caf\xe9\n", "bad/latin1.de": TEXT * 2})),
    ("preprocess-directory-for-file", ["preprocess", "-s", "en", "-t", "de", "--trainpref", "bad/dir",
                                       "--destdir", "out-data"], "directory",
     setup({"bad/dir.de": TEXT}, lambda w: (w / "bad" / "dir.en").mkdir(exist_ok=True))),
    ("preprocess-dangling-symlink", ["preprocess", "-s", "en", "-t", "de", "--trainpref", "bad/link",
                                     "--destdir", "out-data"], "not found",
     setup({"bad/link.de": TEXT}, lambda w: (w / "bad" / "link.en").is_symlink()
           or (w / "bad" / "link.en").symlink_to(w / "bad" / "gone.en"))),
    ("preprocess-damaged-gzip", ["preprocess", "-s", "en", "-t", "de", "--trainpref", "bad/zlib", "--destdir",
                                 "out-data"], "cannot read bad/zlib.en.gz: Error -3 while decompressing data",
     setup(then=corrupt_gzip)),
    ("preprocess-vocab-size-zero", ["preprocess", "-s", "en", "-t", "de", "--trainpref", "raw/train",
                                    "--destdir", "out-data", "--vocab-size", "0"], "--vocab-size", NO_SETUP),
    ("preprocess-destdir-is-a-file", ["preprocess", "-s", "en", "-t", "de", "--trainpref", "raw/train",
                                      "--destdir", "good.hyp", "--vocab-size", "100", "--no-byte-fallback"],
     "good.hyp", NO_SETUP),
    ("preprocess-read-only-destdir", ["preprocess", "-s", "en", "-t", "de", "--trainpref", "raw/train",
                                      "--destdir", "ro/data", "--vocab-size", "100", "--no-byte-fallback"],
     "Read-only file system", setup(then=read_only)),
    ("preprocess-disk-full", ["preprocess", "-s", "en", "-t", "de", "--trainpref", "raw/train",
                              "--destdir", "full/data", "--vocab-size", "100", "--no-byte-fallback"],
     "No space left on device", setup(then=full_disk)),
    # train
    ("train-missing-data-dir", ["train", "nowhere", "--save-dir", "t1", "-q"], "nowhere", NO_SETUP),
    ("train-data-dir-not-preprocessed", ["train", "raw", "--save-dir", "t1", "-q"], "not a finished", NO_SETUP),
    ("train-meta-json-not-a-record", ["train", "bad/meta", "--save-dir", "t1", "-q"],
     "is not an `nmt preprocess` record", setup({"bad/meta/meta.json": '{"source_lang": "en"}'})),
    ("train-tied-embeddings-separate-vocabularies", ["train", "sep-data", "--arch", "transformer_tiny", "-q",
                                                     "--save-dir", "t1"], "needs a joint vocabulary",
     setup(then=separate_vocabularies)),
    ("train-pair-over-max-positions", [*TRAIN, "--set", "max_positions=10", "--save-dir", "t1"],
     "over the model's max_positions 10; pass --skip-invalid-size-inputs", NO_SETUP),
    ("train-unknown-arch", ["train", "data", "--arch", "transformer_huge", "--save-dir", "t1", "-q"],
     "transformer_huge", NO_SETUP),
    ("train-bad-set-key", [*TRAIN, "--set", "dropuot=0.2", "--save-dir", "t1"], "dropuot", NO_SETUP),
    ("train-bad-set-value", [*TRAIN, "--set", "dropout=lots", "--save-dir", "t1"], "dropout", NO_SETUP),
    ("train-sentence-over-max-tokens", ["train", "data", "--arch", "transformer_tiny", "--max-tokens", "5",
                                        "--save-dir", "t1", "-q"], "more than --max-tokens 5", NO_SETUP),
    ("train-fp16-on-cpu", [*TRAIN, "--precision", "fp16", "--device", "cpu", "--save-dir", "t1"], "fp16", NO_SETUP),
    ("train-no-such-valid-split", [*TRAIN, "--valid-subset", "dev", "--save-dir", "t1"], "no split 'dev'", NO_SETUP),
    ("train-eval-bleu-without-validation", [*TRAIN, "--valid-subset", "none", "--eval-bleu", "--save-dir", "t1"],
     "--eval-bleu needs validation", NO_SETUP),
    ("train-restore-file-missing", [*TRAIN, "--restore-file", "missing.pt", "--save-dir", "t1"],
     "--restore-file not found", NO_SETUP),
    ("train-finetune-model-missing", [*TRAIN, "--finetune-from-model", "missing.pt", "--save-dir", "t1"],
     "--finetune-from-model not found", NO_SETUP),
    ("train-save-dir-is-a-file", [*TRAIN, "--save-dir", "good.hyp"], "is a file", NO_SETUP),
    ("train-save-dir-of-another-tool", [*TRAIN, "--save-dir", "theirs"],
     "--save-dir theirs holds metrics.jsonl, which training would replace or append to, and is not a run of nmt's",
     setup({"theirs/metrics.jsonl": "another tool's\n"})),
    ("train-models-dir-of-another-tool", [*TRAIN, "--models", "2", "--threads", "2", "--save-dir", "theirs2"],
     "--save-dir theirs2 holds model1/metrics.jsonl, which training would replace or append to",
     setup({"theirs2/model1/metrics.jsonl": "another tool's\n"})),
    ("train-earlier-run-without-last", [*TRAIN, "--save-dir", "old-run"],
     "--save-dir old-run holds checkpoints of an earlier run (checkpoint1.pt) but no checkpoint_last.pt: continue it "
     "with --restore-file old-run/checkpoint1.pt", setup({"old-run/checkpoint1.pt": b"an earlier run's",
                                                         "old-run/config.yaml": RUN_CONFIG})),
    ("archs-vocab-size-zero", ["archs", "--vocab-size", "0"], "--vocab-size", NO_SETUP),
    ("train-negative-seed", [*TRAIN, "--seed", "-1", "--save-dir", "t1"], "--seed must be at least 0, got -1",
     NO_SETUP),
    ("train-save-dir-is-the-data-dir", [*TRAIN, "--save-dir", "./data"], "--save-dir data is the data directory",
     NO_SETUP),
    ("train-save-dir-in-use", [*TRAIN, "--save-dir", "busy"], "in use by another `nmt train` (pid",
     setup(then=locked_by_another_run)),
    ("train-resume-other-arch", ["train", "data", "--arch", "transformer_small", "--max-tokens", "1000",
                                 "--save-dir", "run", "-q"], "different models", NO_SETUP),
    ("train-resume-other-vocabulary", ["train", "other-data", "--arch", "transformer_tiny", "--max-tokens", "1000",
                                       "--save-dir", "run", "-q"], "different source vocabularies", NO_SETUP),
    ("train-nothing-loads", [*TRAIN, "--save-dir", "broken-run"], "does not load",
     setup({"broken-run/checkpoint_last.pt": b"\0" * 100, "broken-run/checkpoint1.pt": b"garbage",
            "broken-run/config.yaml": RUN_CONFIG})),
    ("train-config-missing", [*TRAIN, "--config", "missing.yaml", "--save-dir", "t1"], "not found", NO_SETUP),
    ("train-config-not-yaml", [*TRAIN, "--config", "bad/recipe.yaml", "--save-dir", "t1"], "not valid YAML",
     setup({"bad/recipe.yaml": "train: [unclosed\n"})),
    ("train-config-typo", [*TRAIN, "--config", "bad/typo.yaml", "--save-dir", "t1"], "max_tokes",
     setup({"bad/typo.yaml": "train:\n  max_tokes: 100\n"})),
    ("train-read-only-save-dir", [*TRAIN, "--save-dir", "ro/ck"], "Read-only file system", setup(then=read_only)),
    ("train-disk-full-at-save", DISK_FULL_RUN, "No space left on device", setup(then=save_dir_on_a_small_disk)),
    # generate
    ("generate-missing-checkpoint", ["generate", "data", "--path", "missing.pt", "-q"], "checkpoint not found",
     NO_SETUP),
    ("generate-truncated-checkpoint", ["generate", "data", "--path", "bad/truncated.pt", "-q"],
     "corrupt or not an nmt checkpoint",
     setup(then=lambda w: write(w / "bad" / "truncated.pt", (w / "model.pt").read_bytes()[:5000]))),
    ("generate-random-checkpoint", ["generate", "data", "--path", "bad/random.pt", "-q"],
     "corrupt or not an nmt checkpoint", setup({"bad/random.pt": bytes(range(256)) * 40})),
    ("generate-empty-checkpoint", ["generate", "data", "--path", "bad/empty.pt", "-q"],
     "corrupt or not an nmt checkpoint", setup({"bad/empty.pt": b""})),
    ("generate-foreign-checkpoint", ["generate", "data", "--path", "bad/foreign.pt", "-q"],
     "corrupt or not an nmt checkpoint",
     setup(then=lambda w: torch.save({"weights": torch.zeros(3)}, w / "bad" / "foreign.pt"))),
    ("generate-flipped-bytes", ["generate", "data", "--path", "flipped.pt", "-q"], "does not match its checksum",
     setup(then=flip_tensor_bytes)),
    ("generate-checkpoint-is-a-directory", ["generate", "data", "--path", "data", "-q"], "directory", NO_SETUP),
    ("generate-other-vocabulary", ["generate", "other-data", "--split", "valid", "--path", "model.pt", "-q"],
     "another sentencepiece model", NO_SETUP),
    ("generate-no-such-split", [*GENERATE, "--split", "dev"], "no split 'dev'", NO_SETUP),
    ("generate-missing-input", ["generate", "-i", "missing.txt", "--path", "model.pt", "-q"],
     "--input not found: missing.txt (relative paths are read from the working directory", NO_SETUP),
    ("generate-missing-prefix-file", [*RAW, "text.en", "--prefix", "missing.txt"], "--prefix not found: missing.txt",
     NO_SETUP),
    ("generate-missing-ban-file", [*RAW, "text.en", "--ban", "missing.txt"], "--ban not found: missing.txt",
     NO_SETUP),
    ("generate-bad-utf8-input", ["generate", "-i", "bad/latin1.txt", "--path", "model.pt", "-q"], "not valid UTF-8",
     setup({"bad/latin1.txt": b"caf\xe9\n"})),
    ("generate-batch-size-zero", [*GENERATE, "--batch-size", "0", "-o", "good.hyp"], "must be at least 1", NO_SETUP),
    ("generate-beam-zero", [*GENERATE, "--beam", "0", "-o", "good.hyp"], "--beam must be at least 1", NO_SETUP),
    ("generate-output-in-the-data-dir", [*GENERATE, "-o", "data/meta.json"],
     "--output data/meta.json is in the data directory data: writing it there could destroy its files", NO_SETUP),
    ("generate-output-is-a-checkpoint", [*RAW, "text.en", "-o", "run/checkpoint_last.pt"],
     "--output run/checkpoint_last.pt is a checkpoint (a zip file, as torch.save writes)", NO_SETUP),
    ("generate-output-is-a-directory", [*GENERATE, "-o", "data"], "is a directory", NO_SETUP),
    ("generate-read-only-output", [*GENERATE, "-o", "ro/test.hyp"], "Read-only file system", setup(then=read_only)),
    ("generate-output-is-the-input", ["generate", "-i", "good.hyp", "--path", "model.pt", "-o", "good.hyp", "-q"],
     "is also the --input", NO_SETUP),
    ("generate-output-is-the-checkpoint", [*GENERATE, "-o", "model.pt"], "is also the --path", NO_SETUP),
    ("generate-print-scores-fairseq", [*GENERATE, "--format", "fairseq", "--print-scores"], "--format plain", NO_SETUP),
    ("generate-buffer-size-on-a-file", [*GENERATE, "--buffer-size", "2"], "--buffer-size applies", NO_SETUP),
    ("generate-buffer-size-with-output", ["generate", "-i", "-", "--path", "model.pt", "-o", "good.hyp",
                                          "--buffer-size", "2", "-q"], "--buffer-size applies", NO_SETUP),
    ("generate-min-len-over-max", [*GENERATE, "--min-len", "9", "--max-len-a", "0", "--max-len-b", "5"],
     "--min-len 9 is over", NO_SETUP),
    ("generate-disk-full", [*GENERATE, "-o", "full/test.hyp"], "No space left on device", setup(then=full_disk)),
    ("generate-output-through-another-users-symlink", [*GENERATE, "-o", "planted.hyp"],
     "planted.hyp is a symbolic link owned by another user (uid 65534)", setup(then=planted_symlink("planted.hyp",
                                                                                                   "good.hyp"))),
    ("generate-output-under-another-users-directory-symlink", [*GENERATE, "-o", "planted-dir/good.hyp"],
     "planted-dir is a symbolic link owned by another user", setup(then=planted_symlink("planted-dir", "."))),
    ("generate-constraint-empty", [*RAW, "bad/c.txt", "--constraints"], "input line 2: constraint 1 is empty",
     setup({"bad/c.txt": "one two\tzwei\nthree\t\n"})),
    ("generate-constraint-unknown-character", [*RAW, "bad/c.txt", "--constraints"],
     "input line 1: constraint 1 'ƒ' has characters the target vocabulary cannot represent (ƒ)",
     setup({"bad/c.txt": "one\tƒ\n"})),
    ("generate-constraint-holds-a-ban", [*RAW, "bad/c.txt", "--constraints", "--ban", "bad/ban.txt"],
     "input line 1: constraint 1 'drei vier' contains the banned phrase 'vier'",
     setup({"bad/c.txt": "one\tdrei vier\n", "bad/ban.txt": "vier\n"})),
    ("generate-prefix-column-without-tab", [*RAW, "text.en", "--prefix-column"], "input line 1 has no tab", NO_SETUP),
    ("generate-prefix-column-extra-fields", [*RAW, "bad/p.txt", "--prefix-column"],
     "input line 1 has 3 tab-separated fields", setup({"bad/p.txt": "one\tzwei\tdrei\n"})),
    ("generate-prefix-over-max-length", [*RAW, "bad/p.txt", "--prefix-column", "--max-len-a", "0", "--max-len-b", "2"],
     "input line 1: the prefix has", setup({"bad/p.txt": "one\tdrei vier fünf sechs\n"})),
    ("generate-prefix-file-line-count", [*RAW, "text.en", "--prefix", "bad/p.txt"], "has 1 lines but the input has 20",
     setup({"bad/p.txt": "zwei\n"})),
    ("generate-prefix-file-and-column", [*RAW, "text.en", "--prefix", "text.de", "--prefix-column"],
     "either as --prefix FILE or in the input", NO_SETUP),
    ("generate-constraints-on-a-split", [*GENERATE, "--constraints"], "read raw text lines (--input FILE|-)", NO_SETUP),
    ("generate-constraints-with-sampling", [*RAW, "text.en", "--constraints", "--sampling"],
     "--constraints need beam search", NO_SETUP),
    ("generate-constraints-with-ctranslate2", [*RAW, "text.en", "--constraints", "--engine", "ctranslate2",
                                               "--lenpen-style", "fairseq"], "has no lexical constraints", NO_SETUP),
    ("generate-ban-file-missing", [*RAW, "text.en", "--ban", "missing.txt"], "not found", NO_SETUP),
    # average
    ("average-other-arch", ["average", "model.pt", "bad/wide.pt", "-o", "good.hyp", "-q"], "ffn_dim",
     setup(then=lambda w: checkpoint_with(w, "bad/wide.pt", other_arch))),
    ("average-other-vocabulary", ["average", "model.pt", "bad/vocab.pt", "-o", "good.hyp", "-q"],
     "different source vocabularies", setup(then=lambda w: checkpoint_with(w, "bad/vocab.pt", other_vocab(w)))),
    ("average-too-few-checkpoints", ["average", "run", "--num-update-checkpoints", "5", "-o", "good.hyp", "-q"],
     "asked for the last 5", NO_SETUP),
    ("average-over-the-last-checkpoint", ["average", "run", "--num-update-checkpoints", "2", "-o",
                                          "run/checkpoint_last.pt", "-q"], "name of a training checkpoint", NO_SETUP),
    ("average-over-an-input", ["average", "model.pt", "run/checkpoint_1_1.pt", "-o", "model.pt", "-q"],
     "is also the input", NO_SETUP),
    ("average-same-file-twice", ["average", "model.pt", "model.pt", "-o", "good.hyp", "-q"], "given twice", NO_SETUP),
    ("average-truncated-input", ["average", "model.pt", "bad/truncated.pt", "-o", "good.hyp", "-q"],
     "corrupt or not an nmt checkpoint",
     setup(then=lambda w: write(w / "bad" / "truncated.pt", (w / "model.pt").read_bytes()[:5000]))),
    ("average-disk-full", ["average", "run/checkpoint_1_1.pt", "run/checkpoint_1_2.pt", "-o", "full/avg.pt", "-q"],
     "No space left on device", setup(then=full_disk)),
    # score
    ("score-line-counts", ["score", "--sys", "text.de", "--ref", "bad/short.de"], "lines",
     setup({"bad/short.de": TEXT})),
    ("score-missing-reference", ["score", "--sys", "text.de", "--ref", "missing.de"], "not found", NO_SETUP),
    ("score-empty-system", ["score", "--sys", "bad/empty.txt", "--ref", "text.de"], "empty",
     setup({"bad/empty.txt": ""})),
    ("score-bad-utf8", ["score", "--sys", "bad/latin1.txt", "--ref", "bad/one.txt"], "not valid UTF-8",
     setup({"bad/latin1.txt": b"caf\xe9\n", "bad/one.txt": "cafe\n"})),
    ("score-unknown-metric", ["score", "--sys", "text.de", "--ref", "text.de", "--metrics", "meteor"], "meteor",
     NO_SETUP),
    # run
    ("run-empty-recipe", ["run", "bad/empty.yaml"], "empty", setup({"bad/empty.yaml": ""})),
    ("run-unknown-section", ["run", "bad/sections.yaml"], "unknown section",
     setup({"bad/sections.yaml": "trian: {}\n"})),
    ("run-unknown-stage", ["run", "bad/stages.yaml", "--stages", "train,deploy"], "deploy",
     setup({"bad/stages.yaml": "train: {}\n"})),
    ("run-no-stage", ["run", "bad/stages.yaml", "--stages", ","], "names no stage",
     setup({"bad/stages.yaml": "train: {}\n"})),
    ("run-output-climbs-out", ["run", "bad/climbs.yaml", "--stages", "generate"],
     "outside.hyp) is outside the recipe's directory (",
     setup({"bad/climbs.yaml": "generate: {input: text.en, path: model.pt, output: ../outside.hyp}\n"})),
    ("run-save-dir-elsewhere", ["run", "bad/elsewhere.yaml", "--dry-run"], "`train: save_dir: /nmt-elsewhere/ck` is "
     "outside",
     setup({"bad/elsewhere.yaml": "data: data\narch: transformer_tiny\ntrain: {save_dir: /nmt-elsewhere/ck}\n"})),
]


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root (mounts included) by its content hash, and every directory.

    A run's metrics.jsonl is left out: it is an append-only record that rightly grows with the
    updates a failed run made (a resume drops the ones it replays)."""
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_dir() and not path.is_symlink():
            files[str(path.relative_to(root))] = "directory"
        elif path.is_file() and not path.is_symlink() and path.name not in ("filler", "metrics.jsonl"):
            files[str(path.relative_to(root))] = hashlib.sha1(path.read_bytes()).hexdigest()
    return files


def run_cli(monkeypatch, capsys, cwd: Path, args: list[str]) -> tuple[int, str, str]:
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["nmt", *args])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_the_catalogue_covers_every_subcommand():
    commands = {args[0] for _, args, _, _ in CASES}
    assert commands == {"preprocess", "train", "generate", "average", "score", "run", "archs"} and len(CASES) >= 40


@pytest.mark.parametrize("case_id,args,expected,prepare", CASES, ids=[case[0] for case in CASES])
def test_bad_input(world, monkeypatch, capsys, case_id, args, expected, prepare):
    prepare(world)
    capsys.readouterr()  # what a setup printed
    before = snapshot(world)
    code, out, err = run_cli(monkeypatch, capsys, world, args)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code != 0, err
    assert "Traceback" not in err, err
    assert len(errors) == 1 and expected in errors[0], err
    assert out == "", out
    assert snapshot(world) == before  # nothing new, nothing changed, nothing half-written


# Inputs that are not errors: read as the user means them, with a warning where something was dropped.
def test_crlf_line_ends_and_a_byte_order_mark_are_read_as_plain_text(world, monkeypatch, capsys):
    write(world / "ok" / "crlf.de", (world / "text.de").read_text(encoding="utf-8").replace("\n", "\r\n"))
    write(world / "ok" / "bom.de", "\ufeff" + (world / "text.de").read_text(encoding="utf-8"))
    scores = []
    for system in ("text.de", "ok/crlf.de", "ok/bom.de"):
        code, out, err = run_cli(monkeypatch, capsys, world, ["score", "--sys", system, "--ref", "text.de"])
        assert code == 0, err
        scores.append(out.split(" = ")[1].split()[0])
        assert ("byte-order mark" in err) == (system == "ok/bom.de")
    assert scores == ["100.00"] * 3


def test_nothing_written_to_a_device_is_replaced(world, monkeypatch, capsys, tmp_path):
    """`-o /dev/null` as root: a device (or FIFO) is written in place, never replaced by a file."""
    device = tmp_path / "null"
    try:
        os.mknod(device, 0o666 | 0o020000, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("making a device node needs root")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    for target in (device, fifo):
        code, out, err = run_cli(monkeypatch, capsys, world, [*GENERATE, "--max-len-b", "3", "-o", str(target)])
        assert code == 0, err
    assert reader.communicate(timeout=30)[0].count(b"\n") == 20  # the FIFO's reader got every line
    assert device.is_char_device() and fifo.is_fifo()
    link = tmp_path / "link.hyp"
    link.symlink_to(world / "kept-by-link.hyp")
    code, _, err = run_cli(monkeypatch, capsys, world, [*GENERATE, "--max-len-b", "3", "-o", str(link)])
    assert code == 0 and link.is_symlink() and len((world / "kept-by-link.hyp").read_text().splitlines()) == 20
    (world / "kept-by-link.hyp").unlink()


def test_a_second_train_on_a_save_dir_in_use_fails_at_once(world, tmp_path):
    """Two real processes: the second names the first's pid and leaves its checkpoints alone."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    first = subprocess.Popen([sys.executable, "-m", "nmt", *TRAIN, "--save-dir", str(tmp_path / "run"),
                              "--max-update", "1000", "--save-interval-updates", "1"], cwd=world, env=env,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "checkpoint_1_1.pt").exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.05)
        second = subprocess.run([sys.executable, "-m", "nmt", *TRAIN, "--save-dir", str(tmp_path / "run")],
                                cwd=world, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1 and "Traceback" not in second.stderr
        assert second.stderr.strip() == (f"error: {tmp_path / 'run'} is in use by another `nmt train` "
                                         f"(pid {first.pid}); wait for it to finish or give another --save-dir")
    finally:
        first.kill()
        first.wait()


def test_torch_versions_that_run_code_from_a_weights_only_checkpoint_are_not_installable():
    """Every checkpoint is read with torch.load(weights_only=True), which is safe only from torch 2.10:
    2.5.1 and below (CVE-2025-32434) and 2.9.1 and below (CVE-2026-24747) run code from a crafted file."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    (torch_requirement,) = [r for r in map(Requirement, project["dependencies"]) if r.name == "torch"]
    assert [v for v in ("2.4.1", "2.5.1", "2.6.0", "2.9.1", "2.10.0", "2.13.0")
            if torch_requirement.specifier.contains(v)] == ["2.10.0", "2.13.0"]


def test_a_full_disk_under_metrics_jsonl_is_a_warning_and_training_goes_on(world, monkeypatch, capsys):
    """metrics.jsonl on a full filesystem (a link to it from the save dir): every record is lost, one
    warning says so, and the run ends with its checkpoints instead of a traceback."""
    full_disk(world)
    save_dir = world / "metrics-on-a-full-disk"
    save_dir.mkdir(exist_ok=True)
    (world / "full" / "metrics.jsonl").touch()
    (save_dir / "metrics.jsonl").unlink(missing_ok=True)
    (save_dir / "metrics.jsonl").symlink_to(world / "full" / "metrics.jsonl")
    (save_dir / "config.yaml").write_text(RUN_CONFIG, encoding="utf-8")  # nmt's run, as training would write it
    code, _, err = run_cli(monkeypatch, capsys, world, [*TRAIN, "--save-dir", str(save_dir), "--max-update", "2",
                                                        "--log-interval", "1"])
    assert code == 0 and "Traceback" not in err, err
    warnings = [line for line in err.splitlines() if "cannot append to" in line]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], err
    assert (save_dir / "checkpoint_last.pt").is_file() and (world / "full" / "metrics.jsonl").stat().st_size == 0


def test_a_metrics_record_that_cannot_be_written_is_lost_with_one_warning(tmp_path, caplog):
    """The same without root: the file cannot be created (its directory is gone). Once it can be written
    again, the next record starts on a line of its own and a reader finds it."""
    from nmt.training.metrics_file import MetricsFile, read_metrics

    metrics = MetricsFile(tmp_path / "gone" / "metrics.jsonl", 0)
    metrics.append({"update": 1})
    metrics.append({"update": 2})
    warning = (f"cannot append to {tmp_path / 'gone' / 'metrics.jsonl'} (No such file or directory): training goes "
               "on; its records are lost until it can write again")
    assert [r.message for r in caplog.records if "cannot append" in r.message] == [warning]
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "metrics.jsonl").write_text('{"update": 0, "torn', encoding="utf-8")
    metrics.append({"update": 3})
    assert [r["update"] for r in read_metrics(tmp_path / "gone" / "metrics.jsonl")] == [3]


def test_a_recipe_trusted_like_code_may_write_elsewhere(world, monkeypatch, capsys, tmp_path):
    """`nmt run --allow-outside`: the output the catalogue refuses is written."""
    write(world / "ok" / "elsewhere.yaml",
          f"generate: {{input: text.en, path: model.pt, output: {tmp_path / 'out.hyp'}, "
          "max_len_b: 3}\n")
    code, _, err = run_cli(monkeypatch, capsys, world, ["run", "ok/elsewhere.yaml", "--stages", "generate",
                                                        "--allow-outside", "-q"])
    assert code == 0, err
    assert len((tmp_path / "out.hyp").read_text(encoding="utf-8").splitlines()) == 20
