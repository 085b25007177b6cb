"""nmt preprocess: the data directory it writes, the pairs it drops, its atomicity, and every bad input."""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import logging
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import typer.main
from conftest import assert_one_line_error, run_cli, run_nmt

from nmt.cli import app
from nmt.data import preprocess as preprocess_module
from nmt.data.binarize import drop_reasons
from nmt.data.corpus import split_names
from nmt.data.dataset import DataDir
from nmt.data.preprocess import PreprocessOptions, preprocess
from nmt.data.summary import summary_table
from nmt.data.vocabulary import EOS_ID, UNK_ID
from nmt.errors import NmtError
from nmt.log import logger

MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"
EN = "a the man woman child dog cat runs sits plays in on with red blue green big small house street park ball " \
     "water tree".split()
DE = "ein der mann frau kind hund katze läuft sitzt spielt im auf mit rot blau grün groß klein haus straße park " \
     "ball wasser baum".split()


def parallel_lines(count: int, seed: int) -> tuple[list[str], list[str]]:
    """Word-for-word 'translations' of random sentences: enough variety for a 100-piece BPE model."""
    rng = random.Random(seed)
    english, german = [], []
    for _ in range(count):
        words = [rng.randrange(len(EN)) for _ in range(rng.randint(3, 12))]
        english.append(" ".join(EN[w] for w in words).capitalize() + ".")
        german.append(" ".join(DE[w] for w in words).capitalize() + ".")
    return english, german


def write_pair(directory: Path, name: str, english: list[str], german: list[str], gz: bool = False) -> str:
    """Write name.en and name.de (optionally gzipped); return the prefix."""
    for lang, lines in (("en", english), ("de", german)):
        data = "".join(line + "\n" for line in lines).encode("utf-8")
        path = directory / f"{name}.{lang}{'.gz' if gz else ''}"
        path.write_bytes(gzip.compress(data) if gz else data)
    return str(directory / name)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """train (300 pairs), valid (40) and test (30) under tmp_path/text."""
    text = tmp_path / "text"
    text.mkdir()
    for name, count, seed in (("train", 300, 0), ("valid", 40, 1), ("test", 30, 2)):
        write_pair(text, name, *parallel_lines(count, seed))
    return text


def make_options(corpus: Path, tmp_path: Path, **overrides) -> PreprocessOptions:
    settings = dict(source_lang="en", target_lang="de", destdir=str(tmp_path / "bin"), trainpref=str(corpus / "train"),
                    validpref=str(corpus / "valid"), testpref=str(corpus / "test"), vocab_size=100,
                    byte_fallback=False)  # 100 pieces leave no room for byte fallback's 256
    return PreprocessOptions(**{**settings, **overrides})


def read_text(path: Path) -> list[str]:
    with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")) as f:
        return [line.rstrip("\n") for line in f]


def assert_round_trips(datadir: DataDir, split: str, source: list[str], target: list[str]) -> None:
    """Every stored sentence ends in its only EOS and decodes to the normalized input line."""
    data = datadir.split(split)
    assert len(data) == len(source) == len(target)
    for side, lines, lang in ((data.source, source, datadir.source_lang), (data.target, target, datadir.target_lang)):
        vocab = datadir.vocabulary(lang)
        for i, line in enumerate(lines):
            ids = side[i]
            assert ids[-1] == EOS_ID and EOS_ID not in ids[:-1]
            assert vocab.decode(ids) == vocab.normalize(line)


def test_builds_a_data_directory_that_round_trips(corpus, tmp_path):
    datadir = preprocess(make_options(corpus, tmp_path), show_progress=False)
    meta = datadir.meta
    assert datadir.path == tmp_path / "bin" and datadir.splits == ["train", "valid", "test"]
    assert meta.joint and meta.vocab_files == {"en": "spm.model", "de": "spm.model"}
    assert meta.vocab_sizes == {"en": 100, "de": 100}
    assert meta.spm_sha256["en"] == datadir.vocabulary("en").sha256
    assert meta.nmt_version and meta.options["vocab_size"] == 100 and "workers" not in meta.options
    for split in ("train", "valid", "test"):
        source, target = read_text(corpus / f"{split}.en"), read_text(corpus / f"{split}.de")
        assert_round_trips(datadir, split, source, target)
        entry = meta.splits[split]
        data = datadir.split(split)
        assert entry.sentences == len(source) and entry.input_lines == len(source)
        assert entry.source_tokens == len(data.source.tokens) and entry.target_tokens == len(data.target.tokens)
        assert data.source.tokens.dtype == np.uint16
    assert meta.splits["train"].dropped == {"empty": 0, "too_long": 0, "ratio": 0}
    assert meta.splits["valid"].dropped is None
    assert "dropped" not in json.loads((datadir.path / "meta.json").read_text())["splits"]["valid"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary directory left


def test_several_valid_and_test_prefixes_get_fairseq_split_names(corpus, tmp_path):
    write_pair(corpus, "valid_b", *parallel_lines(5, 3), gz=True)
    options = make_options(corpus, tmp_path, validpref=f"{corpus}/valid,{corpus}/valid_b", testpref=f"{corpus}/test")
    datadir = preprocess(options, show_progress=False)
    assert datadir.splits == ["train", "valid", "valid1", "test"]
    assert len(datadir.split("valid1")) == 5 and datadir.meta.splits["valid1"].source_file.endswith(".en.gz")
    assert split_names("test", 3) == ["test", "test1", "test2"]


def test_train_drops_empty_too_long_and_badly_proportioned_pairs_only(corpus, tmp_path):
    english, german = parallel_lines(200, 5)
    bad = {3: ("", "Der hund."), 10: ("The dog.", "   "), 20: (" ".join(["the big house"] * 40), "Das."),
           30: ("A dog.", " ".join(["der hund im park"] * 4))}  # 20: too long; 30: 7 vs 37 tokens
    for index, (source, target) in bad.items():
        english[index], german[index] = source, target
    write_pair(corpus, "noisy", english, german)
    options = make_options(corpus, tmp_path, trainpref=str(corpus / "noisy"), max_len=60, max_len_ratio=4)
    datadir = preprocess(options, show_progress=False)
    assert datadir.meta.splits["train"].dropped == {"empty": 2, "too_long": 1, "ratio": 1}
    assert datadir.meta.splits["train"].input_lines == 200
    kept = [i for i in range(200) if i not in bad]
    assert_round_trips(datadir, "train", [english[i] for i in kept], [german[i] for i in kept])


def test_drop_reasons_count_each_pair_once_and_zero_disables():
    source, target = np.array([0, 5, 30, 2, 3]), np.array([4, 0, 3, 20, 3])
    reasons = drop_reasons(source, target, max_len=25, max_len_ratio=3)
    assert {k: v.tolist() for k, v in reasons.items()} == {
        "empty": [True, True, False, False, False], "too_long": [False, False, True, False, False],
        "ratio": [False, False, False, True, False]}
    off = drop_reasons(source, target, max_len=0, max_len_ratio=0)
    assert not off["too_long"].any() and not off["ratio"].any()


def test_separate_vocabularies_and_reusing_a_model(corpus, tmp_path):
    separate = preprocess(make_options(corpus, tmp_path, joint=False, vocab_size=80), show_progress=False)
    assert separate.meta.vocab_files == {"en": "spm.en.model", "de": "spm.de.model"}
    assert not separate.meta.joint and separate.vocabulary("en") != separate.vocabulary("de")
    models = f"{separate.path}/spm.en.model,{separate.path}/spm.de.model"
    reused = preprocess(make_options(corpus, tmp_path, destdir=str(tmp_path / "reused"), trainpref=None,
                                     validpref=None, spm_model=models), show_progress=False)
    assert reused.splits == ["test"] and reused.meta.spm_sha256 == separate.meta.spm_sha256
    assert_round_trips(reused, "test", read_text(corpus / "test.en"), read_text(corpus / "test.de"))


def test_unigram_model_type(corpus, tmp_path):
    datadir = preprocess(make_options(corpus, tmp_path, model_type="unigram"), show_progress=False)
    proto = datadir.vocabulary("en").processor
    assert len(proto) == 100 and datadir.meta.options["model_type"] == "unigram"


def test_unknown_characters_in_valid_are_counted_as_unk(corpus, tmp_path):
    english, german = parallel_lines(10, 7)
    english[4] = "A dog with a ñandú."
    write_pair(corpus, "valid", english, german)
    datadir = preprocess(make_options(corpus, tmp_path), show_progress=False)
    assert datadir.meta.splits["valid"].source_unk >= 1 and datadir.meta.splits["valid"].target_unk == 0
    assert UNK_ID in datadir.split("valid").source[4]
    assert_round_trips(datadir, "valid", english, german)


def test_byte_fallback_keeps_unknown_characters_as_bytes(corpus, tmp_path):
    english, german = parallel_lines(10, 7)
    english[4] = "A dog in 東京 with a ñandú 🐕."
    write_pair(corpus, "valid", english, german)
    datadir = preprocess(make_options(corpus, tmp_path, vocab_size=320, byte_fallback=True), show_progress=False)
    assert datadir.meta.splits["valid"].source_unk == 0
    vocab = datadir.vocabulary("en")
    assert vocab.decode(datadir.split("valid").source[4]) == english[4]  # the text itself, not " ⁇ "
    pieces = [vocab.piece(int(i)) for i in datadir.split("valid").source[4]]
    assert sum(piece.startswith("<0x") for piece in pieces) >= len("東京🐕".encode())  # spelled in bytes


# --- streaming: chunks of pairs are read, checked, encoded and written one at a time ------------------------------


def data_files(datadir: DataDir) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(datadir.path.iterdir()) if path.suffix == ".npy"}


def test_chunk_boundaries_and_workers_do_not_change_the_output(corpus, tmp_path):
    whole = preprocess(make_options(corpus, tmp_path, destdir=str(tmp_path / "whole")), show_progress=False)
    for chunk_lines, workers in ((7, 1), (1, 2), (40, 2)):  # 7 divides none of 300/40/30; 40 is valid's size
        chunked = preprocess(make_options(corpus, tmp_path, destdir=str(tmp_path / f"c{chunk_lines}"), workers=workers),
                             show_progress=False, chunk_lines=chunk_lines)
        assert data_files(chunked) == data_files(whole), (chunk_lines, workers)
        assert chunked.meta.splits == whole.meta.splits
        # sentencepiece trained with the workers' threads: the same pieces (its model file records num_threads)
        assert vocabulary_pieces(chunked) == vocabulary_pieces(whole)


def vocabulary_pieces(datadir: DataDir) -> list[str]:
    vocab = datadir.vocabulary("en")
    return [vocab.piece(i) for i in range(len(vocab))]


def test_a_missing_final_newline_loses_no_line(corpus, tmp_path):
    english, german = parallel_lines(40, 1)
    write_pair(corpus, "valid", english, german)
    (corpus / "valid.de").write_bytes((corpus / "valid.de").read_bytes().rstrip(b"\n"))
    datadir = preprocess(make_options(corpus, tmp_path), show_progress=False, chunk_lines=8)
    assert datadir.meta.splits["valid"].input_lines == 40
    assert_round_trips(datadir, "valid", english, german)


def assert_fails_leaving_nothing(corpus, tmp_path, message: str, **options) -> None:
    with pytest.raises(NmtError) as error:
        preprocess(make_options(corpus, tmp_path, **options), show_progress=False, chunk_lines=7)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text"]  # no destdir, no temporary directory


def test_bad_utf8_in_the_last_chunk_names_the_line(corpus, tmp_path):
    for name, line in (("test.de", 30), ("train.en", 299)):  # found by encoding (test) or by sentencepiece (train)
        path = corpus / name
        original = path.read_bytes()
        lines = original.split(b"\n")
        lines[line - 1] = b"Der hund \xff im park."
        path.write_bytes(b"\n".join(lines))
        assert_fails_leaving_nothing(corpus, tmp_path, f"{path}: line {line} is not valid UTF-8")
        path.write_bytes(original)


def test_a_line_count_mismatch_found_late_gives_both_totals(corpus, tmp_path):
    english, german = parallel_lines(300, 0)
    write_pair(corpus, "train", english, german + ["Ein hund."])  # one more line, after the last chunk
    assert_fails_leaving_nothing(corpus, tmp_path, f"line counts differ in split train: {corpus}/train.en has 300 "
                                                   f"lines but {corpus}/train.de has 301")
    write_pair(corpus, "train", english, german)
    english, german = parallel_lines(30, 2)
    write_pair(corpus, "test", english[:-1], german)
    assert_fails_leaving_nothing(corpus, tmp_path, f"{corpus}/test.en has 29 lines but {corpus}/test.de has 30")


def test_an_empty_line_in_a_late_chunk_of_valid_names_its_line(corpus, tmp_path):
    english, german = parallel_lines(40, 1)
    english[37] = ""
    write_pair(corpus, "valid", english, german)
    assert_fails_leaving_nothing(corpus, tmp_path, f"{corpus}/valid.en: line 38 is empty")


def test_same_request_is_up_to_date_a_different_one_needs_force(corpus, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(logger, "propagate", True)  # the CLI's logging set-up turns it off; caplog listens at root
    caplog.set_level(logging.INFO, logger="nmt")
    options = make_options(corpus, tmp_path)
    first = preprocess(options, show_progress=False)
    meta_time = (first.path / "meta.json").stat().st_mtime_ns
    assert preprocess(dataclasses.replace(options, workers=2), show_progress=False).meta == first.meta
    assert (first.path / "meta.json").stat().st_mtime_ns == meta_time  # nothing rebuilt
    assert "up to date" in caplog.text
    with pytest.raises(NmtError, match=r"different dataset \(differs in: vocab_size\).*--force"):
        preprocess(dataclasses.replace(options, vocab_size=90), show_progress=False)
    write_pair(corpus, "test", *parallel_lines(31, 9))  # an input file changed
    with pytest.raises(NmtError, match=r"differs in: input files"):
        preprocess(options, show_progress=False)
    rebuilt = preprocess(dataclasses.replace(options, vocab_size=90, force=True), show_progress=False)
    assert rebuilt.meta.vocab_sizes["en"] == 90 and len(rebuilt.split("test")) == 31
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "text"]  # the old one moved aside, then deleted


def test_a_corpus_copied_again_is_the_same_dataset_an_edit_of_the_same_size_is_not(corpus, tmp_path):
    options = make_options(corpus, tmp_path)
    first = preprocess(options, show_progress=False)
    meta_time = (first.path / "meta.json").stat().st_mtime_ns
    train = corpus / "train.en"
    os.utime(train, ns=(1_000_000_000, 1_000_000_000))  # copied or mounted again: same bytes, new mtime
    assert preprocess(options, show_progress=False).meta == first.meta
    assert (first.path / "meta.json").stat().st_mtime_ns == meta_time
    text = train.read_bytes()
    train.write_bytes(text.replace(b"a", b"b", 1))  # one letter changed: same size, same mtime
    os.utime(train, ns=(1_000_000_000, 1_000_000_000))
    with pytest.raises(NmtError, match=r"differs in: input files"):
        preprocess(options, show_progress=False)


def test_a_dataset_recorded_without_digests_is_compared_by_size_and_mtime(corpus, tmp_path):
    options = make_options(corpus, tmp_path)
    first = preprocess(options, show_progress=False)
    meta_file = first.path / "meta.json"
    meta = json.loads(meta_file.read_text())
    for stamp in meta["inputs"].values():
        del stamp["sha256"]
    meta_file.write_text(json.dumps(meta))
    assert preprocess(options, show_progress=False).meta.inputs == meta["inputs"]  # up to date: kept as it was
    os.utime(corpus / "train.en", ns=(1_000_000_000, 1_000_000_000))
    with pytest.raises(NmtError, match=r"differs in: input files"):
        preprocess(options, show_progress=False)


def test_the_same_files_by_a_relative_path_are_the_same_dataset(corpus, tmp_path, monkeypatch):
    options = make_options(corpus, tmp_path)
    first = preprocess(options, show_progress=False)
    meta_time = (first.path / "meta.json").stat().st_mtime_ns
    monkeypatch.chdir(corpus.parent)
    relative = dataclasses.replace(options, trainpref="text/train", validpref="./text/valid",
                                   testpref="text/../text/test")
    assert preprocess(relative, show_progress=False).meta == first.meta  # not "a different dataset"
    assert (first.path / "meta.json").stat().st_mtime_ns == meta_time
    with pytest.raises(NmtError, match=r"differs in: testpref"):  # other files are still another dataset
        preprocess(dataclasses.replace(relative, testpref="text/valid"), show_progress=False)


def test_an_interrupted_build_leaves_no_dataset_and_the_old_one_intact(corpus, tmp_path, monkeypatch):
    original = preprocess_module.binarize_split
    calls = []

    def interrupted(workdir, split, *args):
        calls.append(split.name)
        if split.name == "valid":
            raise KeyboardInterrupt
        return original(workdir, split, *args)

    monkeypatch.setattr(preprocess_module, "binarize_split", interrupted)
    with pytest.raises(KeyboardInterrupt):
        preprocess(make_options(corpus, tmp_path), show_progress=False)
    assert calls == ["train", "valid"] and sorted(p.name for p in tmp_path.iterdir()) == ["text"]

    monkeypatch.setattr(preprocess_module, "binarize_split", original)
    old = preprocess(make_options(corpus, tmp_path), show_progress=False)
    old_meta, old_files = (old.path / "meta.json").read_text(), data_files(old)
    monkeypatch.setattr(preprocess_module, "binarize_split", interrupted)
    with pytest.raises(KeyboardInterrupt):
        preprocess(make_options(corpus, tmp_path, vocab_size=90, force=True), show_progress=False)
    assert (old.path / "meta.json").read_text() == old_meta and data_files(DataDir.open(old.path)) == old_files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "text"]


@pytest.mark.slow
def test_multi30k_end_to_end_round_trip(tmp_path):
    if not (MULTI30K / "val.en.gz").exists():
        pytest.skip(f"Multi30k not found at {MULTI30K} (the shared data directory is absent)")
    # The 1,014-line val set stands in for train to keep this to about a second.
    options = PreprocessOptions(source_lang="en", target_lang="de", destdir=str(tmp_path / "m30k"),
                                trainpref=str(MULTI30K / "val"), validpref=str(MULTI30K / "test_2016_flickr"),
                                vocab_size=1000, workers=2)
    datadir = preprocess(options, show_progress=False)
    for split, prefix in (("train", "val"), ("valid", "test_2016_flickr")):
        source, target = read_text(MULTI30K / f"{prefix}.en.gz"), read_text(MULTI30K / f"{prefix}.de.gz")
        assert datadir.meta.splits[split].input_lines == len(source)
        assert_round_trips(datadir, split, source, target)  # so nothing was dropped from train either


# --- the command line ---------------------------------------------------------------------------------------------


def cli_args(corpus: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["preprocess", "-s", "en", "-t", "de", "--trainpref", str(corpus / "train"), "--validpref",
            str(corpus / "valid"), "--destdir", str(tmp_path / "bin"), "--vocab-size", "100", "--no-byte-fallback",
            *extra]


def assert_cli_error(monkeypatch, capsys, args: list[str], *expected: str) -> str:
    code, out, err = run_cli(monkeypatch, capsys, *args, "--quiet")
    assert code == 1, err
    return assert_one_line_error(err, *expected)


def test_cli_builds_and_prints_a_summary(corpus, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, *cli_args(corpus, tmp_path, "--workers", "2"))
    assert code == 0, err
    assert "train" in out and "valid" in out and "300" in out and "dropped" in out
    assert "encoding train" in err  # the progress bar
    assert DataDir.open(tmp_path / "bin").meta.splits["valid"].sentences == 40


def test_cli_json_logs_have_no_progress_bars(corpus, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, *cli_args(corpus, tmp_path, "--log-format", "json"))
    assert code == 0, err
    records = [json.loads(line) for line in err.splitlines()]
    train = next(r for r in records if r.get("split") == "train")
    assert train["sentences"] == 300 and train["dropped"] == {"empty": 0, "too_long": 0, "ratio": 0}


def test_cli_options_are_the_dataclass_fields_with_the_same_defaults():
    command = typer.main.get_command(app).commands["preprocess"]
    shared = {"verbose", "quiet", "log_format"}
    cli = {param.name: param.default for param in command.params if param.name not in shared}
    fields = {field.name: field.default for field in dataclasses.fields(PreprocessOptions)}
    assert set(cli) == set(fields)
    for name, default in fields.items():
        if default is not dataclasses.MISSING:
            assert getattr(cli[name], "value", cli[name]) == default, name
    long_names = {param.name: param.opts for param in command.params}
    assert all(f"--{name.replace('_', '-')}" in long_names[name] for name in fields)


def test_missing_file(corpus, tmp_path, monkeypatch, capsys):
    (corpus / "train.de").unlink()
    assert_cli_error(monkeypatch, capsys, cli_args(corpus, tmp_path), f"{corpus}/train.de", "not found",
                          "train.en")
    assert not (tmp_path / "bin").exists()


def test_missing_prefix_and_directory(corpus, tmp_path, monkeypatch, capsys):
    args = cli_args(corpus, tmp_path)
    args[args.index("--validpref") + 1] = str(corpus / "vaild")
    assert_cli_error(monkeypatch, capsys, args, "vaild.en", "no file", "starts with vaild.")
    args[args.index("--validpref") + 1] = str(tmp_path / "nowhere" / "valid")
    assert_cli_error(monkeypatch, capsys, args, "does not exist")
    assert not (tmp_path / "bin").exists()


def test_unknown_language_suffix_lists_the_files_there_are(corpus, tmp_path, monkeypatch, capsys):
    args = cli_args(corpus, tmp_path)
    args[args.index("-s") + 1] = "eng"
    assert_cli_error(monkeypatch, capsys, args, "train.eng", "'eng'", "train.de, train.en")
    assert not (tmp_path / "bin").exists()


def test_mismatched_line_counts_name_both_files(corpus, tmp_path, monkeypatch, capsys):
    english, german = parallel_lines(40, 1)
    write_pair(corpus, "valid", english, german[:-1])
    assert_cli_error(monkeypatch, capsys, cli_args(corpus, tmp_path), f"{corpus}/valid.en has 40 lines",
                          f"{corpus}/valid.de has 39")
    assert not (tmp_path / "bin").exists()


def test_invalid_utf8_names_file_and_line(corpus, tmp_path, monkeypatch, capsys):
    lines = (corpus / "train.de").read_bytes().split(b"\n")
    lines[250] = b"Der hund \xff\xfe im park."
    (corpus / "train.de").write_bytes(b"\n".join(lines))
    assert_cli_error(monkeypatch, capsys, cli_args(corpus, tmp_path), f"{corpus}/train.de: line 251",
                          "not valid UTF-8")
    assert not (tmp_path / "bin").exists()


def test_empty_line_in_valid_is_an_error_naming_file_and_line(corpus, tmp_path, monkeypatch, capsys):
    english, german = parallel_lines(40, 1)
    german[16] = " "
    write_pair(corpus, "valid", english, german)
    assert_cli_error(monkeypatch, capsys, cli_args(corpus, tmp_path), f"{corpus}/valid.de: line 17 is empty")
    assert not (tmp_path / "bin").exists()


@pytest.mark.parametrize("size, expected", [("5000", "--vocab-size 5000 is too large for this corpus: at most"),
                                            ("20", "--vocab-size 20 is too small")])
def test_vocab_size_the_corpus_cannot_give(corpus, tmp_path, monkeypatch, capsys, size, expected):
    args = cli_args(corpus, tmp_path)
    args[args.index("--vocab-size") + 1] = size
    assert_cli_error(monkeypatch, capsys, args, expected)
    assert not (tmp_path / "bin").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["text"]


def test_destdir_with_another_dataset_is_refused_and_left_alone(corpus, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, *cli_args(corpus, tmp_path), "--quiet")
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in (tmp_path / "bin").iterdir()}
    assert_cli_error(monkeypatch, capsys, cli_args(corpus, tmp_path, "--no-joint"), "different dataset",
                          "joint", "--force")
    assert {p.name: p.read_bytes() for p in (tmp_path / "bin").iterdir()} == before
    code, _, err = run_cli(monkeypatch, capsys, *cli_args(corpus, tmp_path, "--no-joint", "--force"), "--quiet")
    assert code == 0 and DataDir.open(tmp_path / "bin").meta.joint is False


def test_destdir_with_other_files_is_refused_even_with_force(corpus, tmp_path, monkeypatch, capsys):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "notes.txt").write_text("mine")
    assert_cli_error(monkeypatch, capsys, cli_args(corpus, tmp_path), "not a finished nmt dataset",
                     "--force only replaces a dataset")
    assert_cli_error(monkeypatch, capsys, cli_args(corpus, tmp_path, "--force"), "not a finished nmt dataset")
    assert [p.name for p in (tmp_path / "bin").iterdir()] == ["notes.txt"]
    assert (tmp_path / "bin" / "notes.txt").read_text() == "mine"


def test_a_dataset_holding_the_input_text_is_never_replaced(corpus, tmp_path, monkeypatch, capsys):
    """A rebuild deletes the old directory whole: refused when the corpus lives inside it."""
    assert run_cli(monkeypatch, capsys, *cli_args(corpus, tmp_path), "--quiet")[0] == 0
    for name in ("train.en", "train.de"):
        (tmp_path / "bin" / name).write_bytes((corpus / name).read_bytes())
    args = cli_args(corpus, tmp_path, "--force")
    args[args.index("--trainpref") + 1] = str(tmp_path / "bin" / "train")
    assert_cli_error(monkeypatch, capsys, args, "holds the input", "train.", "would delete it")
    assert (tmp_path / "bin" / "train.en").read_bytes() == (corpus / "train.en").read_bytes()
    assert (tmp_path / "bin" / "meta.json").is_file()
    for name in ("train.en", "train.de"):
        (tmp_path / "bin" / name).unlink()
    args = cli_args(corpus, tmp_path, "--force", "--spm-model", str(tmp_path / "bin" / "spm.model"))
    assert run_cli(monkeypatch, capsys, *args, "--quiet")[0] == 0  # its own sentencepiece model is read first


def test_force_never_deletes_what_preprocess_did_not_write(corpus, tmp_path, monkeypatch, capsys):
    assert run_cli(monkeypatch, capsys, *cli_args(corpus, tmp_path), "--quiet")[0] == 0
    (tmp_path / "bin" / "NOTES.txt").write_text("mine\n")
    (tmp_path / "bin" / "runs").mkdir()
    assert_cli_error(monkeypatch, capsys, cli_args(corpus, tmp_path, "--force"),
                     "also holds what `nmt preprocess` did not write (NOTES.txt, runs)", "move them out")
    assert (tmp_path / "bin" / "NOTES.txt").read_text() == "mine\n" and (tmp_path / "bin" / "runs").is_dir()
    (tmp_path / "bin" / "NOTES.txt").unlink()
    (tmp_path / "bin" / "runs").rmdir()
    assert run_cli(monkeypatch, capsys, *cli_args(corpus, tmp_path, "--force"), "--quiet")[0] == 0  # its own only


@pytest.mark.parametrize("extra, expected", [
    (["-t", "en"], "--source-lang and --target-lang are both 'en'"),
    (["-t", "de/x"], "--target-lang 'de/x' is not a language code"),
    (["--max-len-ratio", "0.5"], "--max-len-ratio must be >= 1"),
    (["--workers", "0"], "--workers must be at least 1, got 0"),
    (["--spm-model", "a,b,c"], "--spm-model takes one path"),
])
def test_bad_option_values(corpus, tmp_path, monkeypatch, capsys, extra, expected):
    assert_cli_error(monkeypatch, capsys, cli_args(corpus, tmp_path, *extra), expected)
    assert not (tmp_path / "bin").exists()


def test_options_without_text_to_train_on():
    with pytest.raises(NmtError, match="give --spm-model"):
        preprocess(PreprocessOptions("en", "de", "out", testpref="x"))
    with pytest.raises(NmtError, match="nothing to do"):
        preprocess(PreprocessOptions("en", "de", "out"))


@pytest.mark.slow
def test_errors_reach_the_console_script_as_one_line(corpus, tmp_path):
    (corpus / "valid.en").unlink()
    result = run_nmt(*cli_args(corpus, tmp_path))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: file not found: {corpus}/valid.en")


def test_a_reused_model_with_other_special_ids_is_refused(corpus, tmp_path):
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(read_text(corpus / "train.en")), model_writer=proto,
                                   vocab_size=60, minloglevel=2)  # sentencepiece's own ids: unk=0, bos=1, eos=2
    (tmp_path / "plain.model").write_bytes(proto.getvalue())
    with pytest.raises(NmtError, match="special ids"):
        preprocess(make_options(corpus, tmp_path, spm_model=str(tmp_path / "plain.model")), show_progress=False)
    assert not (tmp_path / "bin").exists()


def test_destdir_that_cannot_be_a_directory(corpus, tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    args = cli_args(corpus, tmp_path)
    args[args.index("--destdir") + 1] = str(tmp_path / "file")
    assert_cli_error(monkeypatch, capsys, args, f"--destdir {tmp_path}/file exists and is not a directory")
    args[args.index("--destdir") + 1] = str(tmp_path / "file" / "bin")
    assert_cli_error(monkeypatch, capsys, args, f"cannot create a directory in {tmp_path}/file")
    assert (tmp_path / "file").read_text() == "x"


def test_the_raw_files_are_recorded_wherever_generate_runs_from(corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(corpus.parent)
    relative = corpus.name
    options = make_options(corpus, tmp_path, trainpref=f"{relative}/train", validpref=None, testpref=f"{relative}/test")
    entry = preprocess(options, show_progress=False).meta.splits["test"]
    monkeypatch.chdir(tmp_path)  # `nmt generate --score-reference` from another directory still finds them
    assert Path(entry.source_file) == corpus.resolve() / "test.en" and Path(entry.target_file).is_file()


def test_subword_samples_are_other_segmentations_of_the_same_pairs(corpus, tmp_path):
    datadir = preprocess(make_options(corpus, tmp_path, subword_samples=2), show_progress=False)
    assert datadir.splits == ["train", "valid", "test"]  # the samples are not splits to decode or validate on
    assert list(datadir.meta.samples) == ["train.sample1", "train.sample2"]
    source, target = read_text(corpus / "train.en"), read_text(corpus / "train.de")
    best, samples = datadir.split("train"), datadir.samples("train")
    assert len(samples) == 2 and samples[0].source.prefix == datadir.path / "train.sample1.en"
    for sample in samples:
        vocab = datadir.vocabulary("en")
        assert [vocab.decode(sample.source[i]) for i in range(len(sample))] == [vocab.normalize(s) for s in source]
        assert [vocab.decode(sample.target[i]) for i in range(len(sample))] == [vocab.normalize(s) for s in target]
        assert sample.source.sizes.sum() > best.source.sizes.sum()  # merges dropped: more, shorter pieces
    assert not np.array_equal(samples[0].target.tokens, samples[1].target.tokens)
    assert datadir.meta.samples["train.sample1"].sentences == len(source)
    sizes = sorted(sum(part.sizes.sum() for part in (sample.source, sample.target)) for sample in samples)
    shown = f"{sizes[0]:,}-{sizes[-1]:,}"
    assert datadir.meta.sample_tokens() == shown
    assert summary_table(datadir).caption == (f"and 2 sampled segmentations of train (--subword-samples), {shown} "
                                              "tokens each, read one an epoch")
    for workers in (1, 2):  # seeded, on one thread: the same text gives the same samples
        again = preprocess(make_options(corpus, tmp_path, subword_samples=2, workers=workers,
                                        destdir=str(tmp_path / f"again{workers}")), show_progress=False)
        assert data_files(again) == data_files(datadir)
    assert DataDir.open(datadir.path).meta.samples == datadir.meta.samples  # meta.json keeps them
    rebuilt = preprocess(make_options(corpus, tmp_path, force=True), show_progress=False)  # the samples are its own
    assert rebuilt.meta.samples == {} and not list(rebuilt.path.glob("train.sample*"))
    assert "subword_samples" not in rebuilt.meta.options  # as recorded before the option: older directories match


@pytest.mark.parametrize("options, message", [({"subword_alpha": 0.0}, "--subword-alpha must be in (0, 1)"),
                                              ({"subword_alpha": 1.0}, "--subword-alpha must be in (0, 1)"),
                                              ({"subword_samples": 2, "trainpref": None, "spm_model": "spm.model"},
                                               "--subword-samples samples the training text")])
def test_bad_subword_sampling_options(corpus, tmp_path, options, message):
    with pytest.raises(NmtError, match=re.escape(message)):
        make_options(corpus, tmp_path, **options)
