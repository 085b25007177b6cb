"""Finding and reading the raw parallel text of ``nmt preprocess``: ``PREFIX.LANG`` files, checked.

Files are found before any work; their text is then streamed in chunks of pairs, so a corpus of
any size is read in bounded memory. Every problem is raised as a one-line NmtError that names the
file (and line) to fix, when the reading reaches it: a missing file or language suffix, unequal
line counts, bad UTF-8, and empty lines in the valid/test sets, whose line i must stay line i.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Iterator

from nmt.errors import NmtError
from nmt.files import open_binary, text_lines

SPLIT_KINDS = ("train", "valid", "test")


@dataclass(frozen=True)
class SplitFiles:
    """The two text files of one split, e.g. name="valid1" for the second --validpref."""

    name: str
    source: Path
    target: Path

    @property
    def keeps_every_line(self) -> bool:
        """Only the training split may drop pairs; valid/test outputs stay aligned with their inputs."""
        return self.name != "train"


def split_names(kind: str, count: int) -> list[str]:
    """fairseq's names for several comma-separated prefixes: valid, valid1, valid2, ..."""
    return [kind if i == 0 else f"{kind}{i}" for i in range(count)]


def text_file_names(prefix: str, lang: str) -> tuple[Path, Path]:
    """Where a prefix's text in one language may be: ``PREFIX.LANG``, then ``PREFIX.LANG.gz``."""
    plain = Path(f"{prefix}.{lang}")
    return plain, Path(f"{plain}.gz")


def split_prefixes(option: str) -> list[str]:
    """The prefixes of a comma-separated --trainpref/--validpref/--testpref."""
    return [prefix.strip() for prefix in option.split(",")]


def find_text_file(prefix: str, lang: str) -> Path:
    """``PREFIX.LANG`` or ``PREFIX.LANG.gz``; when neither exists, say which files the prefix has."""
    candidates = text_file_names(prefix, lang)
    plain = candidates[0]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    if plain.is_dir():
        raise NmtError(f"expected a file, got a directory: {plain}")
    directory, stem = plain.parent, Path(prefix).name
    # A recipe run from another directory is the usual cause: say where a relative path was looked for.
    where = "" if plain.is_absolute() else f" (relative paths are read from the working directory {Path.cwd()})"
    if not directory.is_dir():
        raise NmtError(f"file not found: {plain} (nor {plain}.gz): directory {directory} does not exist{where}")
    siblings = sorted(p.name for p in directory.iterdir() if p.name.startswith(f"{stem}.") and p.is_file())
    if not siblings:
        raise NmtError(f"file not found: {plain} (nor {plain}.gz), and no file in {directory} starts with "
                       f"{stem}.{where}")
    shown = ", ".join(siblings[:10]) + (f" and {len(siblings) - 10} more" if len(siblings) > 10 else "")
    raise NmtError(f"file not found: {plain} (nor {plain}.gz) for language {lang!r}; "
                   f"files with prefix {prefix} are: {shown}")


def find_splits(source_lang: str, target_lang: str, trainpref: str | None, validpref: str | None,
                testpref: str | None) -> list[SplitFiles]:
    """All splits named by the prefix options, each prefix option possibly comma-separated."""
    splits = []
    for kind, prefixes in zip(SPLIT_KINDS, (trainpref, validpref, testpref)):
        if not prefixes:
            continue
        names = split_prefixes(prefixes)
        if any(not p for p in names):
            raise NmtError(f"--{kind}pref {prefixes!r} has an empty prefix")
        if kind == "train" and len(names) > 1:
            raise NmtError("--trainpref takes one prefix (concatenate the training corpora first)")
        for name, prefix in zip(split_names(kind, len(names)), names):
            splits.append(SplitFiles(name, find_text_file(prefix, source_lang), find_text_file(prefix, target_lang)))
    return splits


def file_lines(path: Path) -> Iterator[str]:
    """The lines of one file (plain or .gz), streamed and checked (see ``nmt.files.text_lines``)."""
    with open_binary(path) as handle:
        yield from text_lines(handle, path)


def read_chunks(split: SplitFiles, chunk_lines: int) -> Iterator[tuple[list[str], list[str]]]:
    """Both sides of a split in chunks of up to ``chunk_lines`` pairs, checked as they are read.

    Unequal line counts are found where the shorter file ends; the error then counts the rest of
    the longer one, so it gives both files' totals.
    """
    with contextlib.closing(file_lines(split.source)) as source, contextlib.closing(file_lines(split.target)) as target:
        read = 0
        while True:
            source_chunk, target_chunk = list(islice(source, chunk_lines)), list(islice(target, chunk_lines))
            if len(source_chunk) != len(target_chunk):
                source_total = read + len(source_chunk) + sum(1 for _ in source)
                target_total = read + len(target_chunk) + sum(1 for _ in target)
                raise NmtError(f"line counts differ in split {split.name}: {split.source} has {source_total} lines "
                               f"but {split.target} has {target_total}")
            if not source_chunk:
                break
            if split.keeps_every_line:
                check_no_empty_line(split, source_chunk, target_chunk, first_line=read + 1)
            yield source_chunk, target_chunk
            read += len(source_chunk)
    if read == 0:
        raise NmtError(f"{split.source} and {split.target} are empty")


def check_no_empty_line(split: SplitFiles, source: list[str], target: list[str], first_line: int) -> None:
    for path, lines in ((split.source, source), (split.target, target)):
        empty = next((i for i, line in enumerate(lines, start=first_line) if not line.strip()), None)
        if empty is not None:
            raise NmtError(f"{path}: line {empty} is empty; {split.name} keeps every line aligned with its "
                           "input, so fill or remove that line in both files")
