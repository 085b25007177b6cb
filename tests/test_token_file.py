"""TokenFileWriter: chunks appended before the length is known make the same .npy files as
writing the whole array at once."""

from __future__ import annotations

import numpy as np

from nmt.data.dataset import TokenArray, save_token_array
from nmt.data.token_file import TokenFileWriter


def test_chunks_make_the_files_np_save_makes(tmp_path):
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 30, size=500)
    tokens = rng.integers(4, 60_000, size=int(sizes.sum())).astype(np.uint16)
    writer = TokenFileWriter(tmp_path / "streamed", np.uint16)
    ends = np.cumsum(sizes)
    for start in range(0, 500, 70):  # uneven chunks, the last one shorter
        stop = min(start + 70, 500)
        first, last = (ends[start - 1] if start else 0), ends[stop - 1]
        writer.append(tokens[first:last], sizes[start:stop])
    writer.close()
    offsets = np.concatenate([[0], ends])
    save_token_array(tmp_path / "whole", tokens, offsets)
    for suffix in ("tokens", "offsets"):
        streamed = (tmp_path / f"streamed.{suffix}.npy").read_bytes()
        assert streamed == (tmp_path / f"whole.{suffix}.npy").read_bytes(), suffix
    array = TokenArray(tmp_path / "streamed")
    assert len(array) == 500 and array[499].tolist() == tokens[ends[498]:].tolist()


def test_an_empty_side_is_a_valid_empty_array(tmp_path):
    writer = TokenFileWriter(tmp_path / "empty", np.int32)
    writer.close()
    assert len(TokenArray(tmp_path / "empty")) == 0
    assert np.load(tmp_path / "empty.tokens.npy").dtype == np.int32
