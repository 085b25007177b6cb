"""meta.json, the record ``nmt preprocess`` writes last into a data directory (its presence marks
the directory complete): read and written here only, as a ``DatasetMeta``.

Reading needs source_lang, target_lang, vocab_files and splits (with each split's sentence
count); the rest is optional, so a data directory made by other means (tests, benchmarks) opens
too. Keys this version does not know are ignored.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nmt.errors import NmtError
from nmt.files import atomic_write

META_FILE = "meta.json"
FORMAT = 1
REQUIRED = {"source_lang": str, "target_lang": str, "splits": dict, "vocab_files": dict}


@dataclass
class SplitMeta:
    """One split as written: its size, where its text came from, and what was dropped (train only)."""

    sentences: int
    input_lines: int | None = None
    source_file: str | None = None  # the raw text, resolved: `generate --score-reference` reads it from any cwd
    target_file: str | None = None
    dropped: dict[str, int] | None = None  # train only: pairs dropped per reason (empty, too_long, ratio)
    source_tokens: int | None = None  # EOS included
    source_unk: int | None = None
    target_tokens: int | None = None
    target_unk: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> "SplitMeta":
        return cls(**{f.name: entry[f.name] for f in dataclasses.fields(cls) if f.name in entry})


@dataclass
class DatasetMeta:
    """What a data directory holds, and the request it was built from (for the up-to-date check)."""

    source_lang: str
    target_lang: str
    vocab_files: dict[str, str]  # lang -> sentencepiece model file in the directory (the same file when joint)
    splits: dict[str, SplitMeta]  # train, valid, valid1, ..., test, ... as written
    vocab_sizes: dict[str, int] = field(default_factory=dict)
    spm_sha256: dict[str, str] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)  # the preprocess options that shape the output
    inputs: dict[str, dict[str, int | str]] = field(default_factory=dict)  # file -> size, mtime_ns, sha256
    nmt_version: str | None = None
    shortlist_file: str | None = None  # the vocabulary shortlist learned from train (nmt/data/shortlist.py)
    samples: dict[str, SplitMeta] = field(default_factory=dict)  # train.sample1, ...: sampled segmentations of train
    format: int = FORMAT

    @property
    def joint(self) -> bool:
        return self.vocab_files[self.source_lang] == self.vocab_files[self.target_lang]

    def sample_tokens(self) -> str:
        """The sampled segmentations' sizes in tokens (both sides), as "least-most" (empty without samples)."""
        tokens = [entry.source_tokens + entry.target_tokens for entry in self.samples.values()]
        return f"{min(tokens):,}-{max(tokens):,}" if tokens else ""

    @classmethod
    def load(cls, directory: Path) -> "DatasetMeta":
        path = directory / META_FILE
        if not path.exists():
            raise NmtError(f"{directory} is not a finished `nmt preprocess` output (no {META_FILE}); "
                           "run preprocess again")
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise NmtError(f"cannot read {path}: {exc}") from exc
        if not is_record(record):
            raise NmtError(f"{path} is not an `nmt preprocess` record (it needs {', '.join(REQUIRED)}); "
                           "run preprocess again")
        known = {f.name for f in dataclasses.fields(cls)} - {"splits", "samples"}
        return cls(splits={name: SplitMeta.from_json(entry) for name, entry in record["splits"].items()},
                   samples={name: SplitMeta.from_json(entry) for name, entry in record.get("samples", {}).items()},
                   **{key: value for key, value in record.items() if key in known})

    def save(self, directory: Path) -> None:
        record = {"format": self.format, "nmt_version": self.nmt_version, "source_lang": self.source_lang,
                  "target_lang": self.target_lang, "joint": self.joint, "vocab_files": self.vocab_files,
                  "vocab_sizes": self.vocab_sizes, "spm_sha256": self.spm_sha256,
                  "splits": {name: split.to_json() for name, split in self.splits.items()},
                  "options": self.options, "inputs": self.inputs,
                  **({"shortlist_file": self.shortlist_file} if self.shortlist_file else {}),
                  **({"samples": {name: split.to_json() for name, split in self.samples.items()}}
                     if self.samples else {})}
        with atomic_write(directory / META_FILE) as handle:
            json.dump(record, handle, indent=2, ensure_ascii=False)
            handle.write("\n")


def is_data_directory(directory: Path) -> bool:
    """Whether ``directory`` holds an `nmt preprocess` output (a readable record in its meta.json)."""
    try:
        return is_record(json.loads((directory / META_FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return False


def is_record(record: Any) -> bool:
    """Whether a parsed meta.json holds what reading needs: the REQUIRED keys, a model file for each
    language, and each split's (and each sample's) number of sentences."""
    return isinstance(record, dict) and all(isinstance(record.get(key), kind) for key, kind in REQUIRED.items()) \
        and {record["source_lang"], record["target_lang"]} <= set(record["vocab_files"]) \
        and isinstance(record.get("samples", {}), dict) \
        and isinstance(record.get("inputs", {}), dict) and all(isinstance(stamp, dict)
                                                              for stamp in record.get("inputs", {}).values()) \
        and all(isinstance(entry, dict) and isinstance(entry.get("sentences"), int)
                for entry in (*record["splits"].values(), *record.get("samples", {}).values()))
