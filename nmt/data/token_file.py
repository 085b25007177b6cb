"""Writing one side of a split as it is encoded, before its length is known."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from nmt.files import atomic_write


class TokenFileWriter:
    """Sentences appended chunk by chunk to ``{prefix}.tokens.npy``; ``{prefix}.offsets.npy`` at the end.

    The .npy header holds the array's length, known only at the end. numpy leaves room in every
    header for the length to grow (so that a file can be appended to), so the header is written
    for length 0 first and written again in place, the same size, when the file is complete.
    """

    def __init__(self, prefix: Path, dtype: np.dtype):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        self.handle = open(f"{prefix}.tokens.npy", "wb")
        self.write_header(0)
        self.header_size = self.handle.tell()
        self.sizes: list[np.ndarray] = []  # per chunk, EOS included
        self.num_tokens = 0

    def write_header(self, length: int) -> None:
        np.lib.format.write_array_header_1_0(self.handle, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                           "fortran_order": False, "shape": (length,)})

    @property
    def num_sentences(self) -> int:
        return sum(map(len, self.sizes))

    def append(self, tokens: np.ndarray, sizes: np.ndarray) -> None:
        """Sentences as stored: their flat tokens (each sentence ending in EOS) and their sizes."""
        self.handle.write(tokens.astype(self.dtype, copy=False).tobytes())
        self.sizes.append(sizes.astype(np.int32))
        self.num_tokens += len(tokens)

    def close(self) -> None:
        self.handle.seek(0)
        self.write_header(self.num_tokens)
        assert self.handle.tell() == self.header_size, "numpy's .npy header no longer leaves room for the length"
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        sizes = np.concatenate(self.sizes) if self.sizes else np.zeros(0, dtype=np.int32)
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        with atomic_write(f"{self.prefix}.offsets.npy", "wb") as handle:
            np.save(handle, offsets)
