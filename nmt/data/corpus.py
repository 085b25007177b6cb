"""Finding and reading the raw parallel text of ``nmt preprocess``: ``PREFIX.LANG`` files, checked.

Every problem is raised as a one-line NmtError that names the file (and line) to fix, before any
work is done: a missing file or language suffix, unequal line counts, bad UTF-8, and empty lines
in the valid/test sets, whose line i must stay line i.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nmt.errors import NmtError
from nmt.files import read_lines

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


def find_text_file(prefix: str, lang: str) -> Path:
    """``PREFIX.LANG`` or ``PREFIX.LANG.gz``; when neither exists, say which files the prefix has."""
    plain = Path(f"{prefix}.{lang}")
    for candidate in (plain, Path(f"{plain}.gz")):
        if candidate.is_file():
            return candidate
    if plain.is_dir():
        raise NmtError(f"expected a file, got a directory: {plain}")
    directory, stem = plain.parent, Path(prefix).name
    if not directory.is_dir():
        raise NmtError(f"file not found: {plain} (directory {directory} does not exist)")
    siblings = sorted(p.name for p in directory.iterdir() if p.name.startswith(f"{stem}.") and p.is_file())
    if not siblings:
        raise NmtError(f"file not found: {plain} (nor {plain}.gz), and no file in {directory} starts with {stem}.")
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
        names = [p.strip() for p in prefixes.split(",")]
        if any(not p for p in names):
            raise NmtError(f"--{kind}pref {prefixes!r} has an empty prefix")
        if kind == "train" and len(names) > 1:
            raise NmtError("--trainpref takes one prefix (concatenate the training corpora first)")
        for name, prefix in zip(split_names(kind, len(names)), names):
            splits.append(SplitFiles(name, find_text_file(prefix, source_lang), find_text_file(prefix, target_lang)))
    return splits


def read_parallel(split: SplitFiles) -> tuple[list[str], list[str]]:
    """Both sides of a split as lists of lines, checked to pair up one to one."""
    source, target = read_lines(split.source), read_lines(split.target)
    if len(source) != len(target):
        raise NmtError(f"line counts differ in split {split.name}: {split.source} has {len(source)} lines "
                       f"but {split.target} has {len(target)}")
    if not source:
        raise NmtError(f"{split.source} and {split.target} are empty")
    if split.keeps_every_line:
        for path, lines in ((split.source, source), (split.target, target)):
            empty = next((i for i, line in enumerate(lines, start=1) if not line.strip()), None)
            if empty is not None:
                raise NmtError(f"{path}: line {empty} is empty; {split.name} keeps every line aligned with its "
                               "input, so fill or remove that line in both files")
    return source, target
