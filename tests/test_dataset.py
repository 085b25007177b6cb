"""Binarized datasets: token arrays with offsets, the dtype they use, and DataDir's checks."""

from __future__ import annotations

import numpy as np
import pytest

from nmt.data.dataset import DataDir, ParallelDataset, TokenArray, save_token_array, smallest_dtype, write_token_array
from nmt.data.meta import DatasetMeta, SplitMeta
from nmt.data.vocabulary import EOS_ID, Vocabulary
from nmt.errors import NmtError


def test_smallest_dtype_fits_every_id():
    assert smallest_dtype(37000) == np.uint16 and smallest_dtype(65536) == np.uint16
    assert smallest_dtype(65537) == np.int32


def test_write_and_read_token_array(tmp_path):
    sentences = [[5, 6, EOS_ID], [EOS_ID], [7, 8, 9, 65535, EOS_ID]]
    write_token_array(tmp_path / "train.en", sentences, vocab_size=65536)
    array = TokenArray(tmp_path / "train.en")
    assert len(array) == 3 and array.sizes.tolist() == [3, 1, 5]
    assert array.tokens.dtype == np.uint16 and isinstance(array.tokens, np.memmap)
    assert [array[i].tolist() for i in range(3)] == sentences
    assert array[2].dtype == np.int64  # ready for torch.long
    big = [[70000, EOS_ID]]
    write_token_array(tmp_path / "big", big, vocab_size=80000)
    assert TokenArray(tmp_path / "big").tokens.dtype == np.int32 and TokenArray(tmp_path / "big")[0].tolist() == big[0]


def test_save_token_array_writes_int64_offsets(tmp_path):
    save_token_array(tmp_path / "x", np.array([4, 5, 3, 3], dtype=np.uint16), np.array([0, 3, 4], dtype=np.int32))
    array = TokenArray(tmp_path / "x")
    assert array.offsets.dtype == np.int64 and [array[i].tolist() for i in range(2)] == [[4, 5, 3], [3]]


def test_inconsistent_or_missing_arrays_are_errors(tmp_path):
    save_token_array(tmp_path / "x", np.array([4, 5, 3], dtype=np.uint16), np.array([0, 2, 5]))
    with pytest.raises(NmtError, match="inconsistent"):
        TokenArray(tmp_path / "x")
    with pytest.raises(NmtError, match="cannot read binarized data"):
        TokenArray(tmp_path / "missing")


def test_parallel_dataset_needs_equal_lengths(tmp_path):
    write_token_array(tmp_path / "a", [[4, 3], [3]], 100)
    write_token_array(tmp_path / "b", [[4, 3]], 100)
    assert len(ParallelDataset(TokenArray(tmp_path / "a"), TokenArray(tmp_path / "a"))) == 2
    with pytest.raises(NmtError, match="source has 2 sentences but target has 1"):
        ParallelDataset(TokenArray(tmp_path / "a"), TokenArray(tmp_path / "b"))


def make_datadir(path, vocab: Vocabulary) -> DataDir:
    path.mkdir()
    vocab.save(path / "spm.model")
    for lang, text in (("en", "the dog runs"), ("de", "a cat sits")):
        write_token_array(path / f"train.{lang}", [vocab.encode(text) + [EOS_ID]], len(vocab))
    meta = DatasetMeta("en", "de", vocab_files={"en": "spm.model", "de": "spm.model"},
                       splits={"train": SplitMeta(sentences=1)})
    meta.save(path)
    return DataDir(path, meta)


def test_datadir_round_trip(tmp_path):
    vocab = Vocabulary.train([f"the dog runs {i} times" for i in range(100)] + ["a cat sits"] * 20, 30)
    written = make_datadir(tmp_path / "bin", vocab)
    opened = DataDir.open(tmp_path / "bin")
    assert opened.meta == written.meta and (opened.source_lang, opened.target_lang) == ("en", "de")
    assert opened.splits == ["train"] and opened.vocabulary("de") == vocab
    train = opened.split("train")
    assert (vocab.decode(train.source[0]), vocab.decode(train.target[0])) == ("the dog runs", "a cat sits")
    with pytest.raises(NmtError, match="has no split 'valid'; it has: train"):
        opened.split("valid")


def test_datadir_open_refuses_unfinished_or_broken_directories(tmp_path):
    with pytest.raises(NmtError, match="data directory not found"):
        DataDir.open(tmp_path / "none")
    (tmp_path / "half").mkdir()
    with pytest.raises(NmtError, match=r"not a finished `nmt preprocess` output \(no meta.json\)"):
        DataDir.open(tmp_path / "half")
    (tmp_path / "half" / "meta.json").write_text("{not json")
    with pytest.raises(NmtError, match="cannot read .*meta.json"):
        DataDir.open(tmp_path / "half")

