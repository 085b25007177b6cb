"""Whether ``nmt preprocess`` has anything to do: a destdir holding this very dataset (same options,
input files of the same content) is kept; only a dataset is ever replaced, and only with --force."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from nmt.data.corpus import SplitFiles
from nmt.data.meta import META_FILE, DatasetMeta
from nmt.errors import NmtError
from nmt.files import sha256_of


def fingerprints(splits: list[SplitFiles], spm_model: str | None) -> dict[str, dict[str, int | str]]:
    """Size, mtime and SHA-256 of every input file. The digest is what tells a finished directory is
    current: a corpus copied or mounted again has new mtimes but is the same corpus (reading it costs
    a fraction of a second per 100 MB, against minutes to rebuild)."""
    paths = [p for split in splits for p in (split.source, split.target)]
    paths += [Path(p) for p in spm_model.split(",")] if spm_model else []
    result: dict[str, dict[str, int | str]] = {}
    for path in paths:
        try:
            stat = path.stat()
            with open(path, "rb") as file:
                digest = sha256_of(file.fileno())
            result[str(path.resolve())] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
        except OSError as exc:
            raise NmtError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return result


def same_inputs(recorded: dict[str, dict[str, int | str]], current: dict[str, dict[str, int | str]]) -> bool:
    """The same files with the same content; a dataset recorded before digests were kept is compared
    by size and mtime."""
    key = "sha256" if all("sha256" in stamp for stamp in recorded.values()) else "mtime_ns"
    return recorded.keys() == current.keys() and all(
        (stamp.get("size"), stamp.get(key)) == (current[path]["size"], current[path][key])
        for path, stamp in recorded.items())


def comparable(options: dict[str, Any], path_keys: Iterable[str]) -> dict[str, Any]:
    """Options with their paths (comma-separated lists of them) made absolute: `data/train` given
    here and `/home/me/data/train` before name the same files."""
    result = dict(options)
    for key in path_keys:
        if result.get(key):
            result[key] = ",".join(str(Path(p.strip()).resolve()) for p in str(result[key]).split(","))
    return result


def is_up_to_date(destdir: Path, options: dict[str, Any], inputs: dict[str, dict[str, int | str]], force: bool,
                  texts: list[Path], path_keys: Iterable[str] = ()) -> bool:
    """True if destdir already holds this very dataset (``options`` and ``inputs`` as meta.json records
    them; the options named by ``path_keys`` are compared as absolute paths). Only a dataset (another
    one with force) is ever replaced, and never one that holds the text it is made from: replacing
    deletes the old directory (a --spm-model inside it is read before and saved again)."""
    if not destdir.exists():
        return False
    if not destdir.is_dir():
        raise NmtError(f"--destdir {destdir} exists and is not a directory")
    if not any(destdir.iterdir()):
        return False
    if not (destdir / META_FILE).exists():
        raise NmtError(f"--destdir {destdir} already exists and is not a finished nmt dataset (no {META_FILE}); "
                       "choose another --destdir (--force only replaces a dataset)")
    meta = DatasetMeta.load(destdir)
    recorded = comparable(meta.options, path_keys)
    changed = [key for key, value in comparable(options, path_keys).items() if recorded.get(key) != value]
    if not same_inputs(meta.inputs, inputs):
        changed.append("input files")
    if not changed and not force:
        return True
    inside = [path for path in texts if path.resolve().is_relative_to(destdir.resolve())]
    if inside:
        raise NmtError(f"--destdir {destdir} holds the input {inside[0]}: rebuilding it would delete it; "
                       "move the input out of it or choose another --destdir")
    others = sorted(entry.name for entry in destdir.iterdir() if entry.name not in written_files(meta))
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise NmtError(f"--destdir {destdir} also holds what `nmt preprocess` did not write ({shown}): rebuilding it "
                       "would delete them; move them out of it or choose another --destdir")
    if force:
        return False
    raise NmtError(f"--destdir {destdir} already holds a different dataset (differs in: {', '.join(changed)}); "
                   "use --force to replace it")


def written_files(meta: DatasetMeta) -> set[str]:
    """The names of the files `nmt preprocess` wrote into a data directory (see nmt/data/dataset.py)."""
    splits = {f"{split}.{lang}.{kind}.npy" for split in (*meta.splits, *meta.samples)
              for lang in (meta.source_lang, meta.target_lang) for kind in ("tokens", "offsets")}
    return {META_FILE, *meta.vocab_files.values(), *([meta.shortlist_file] if meta.shortlist_file else []), *splits}
