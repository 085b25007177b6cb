"""``nmt preprocess``: raw parallel text -> sentencepiece model(s) + binarized splits + meta.json.

Every input file is found first (nmt/data/corpus.py). The text is then streamed, never held
whole: sentencepiece trains on a stream of the training text, keeping a sample of at most
``input_sentence_size`` sentences; each split is read in chunks of pairs, checked as it goes
(UTF-8, line counts, empty lines, with the file and line), encoded by ``workers`` sentencepiece
threads while the next chunk is read, and appended to its token file. Only compact numpy arrays
(a length per sentence) grow with the corpus. Everything is written into a temporary directory
next to ``destdir`` that is renamed into place at the end, meta.json last: bad input found late, a crash or Ctrl-C never leaves a
``destdir`` that DataDir.open accepts. (A run killed outright may leave a hidden ``.NAME.tmp-*``
directory beside it, which the next run removes.)

Running again with the same options and unchanged input files (same size and mtime) does nothing
and says the directory is up to date; ``force`` rebuilds it.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import os
import re
import shutil
import uuid
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Callable, Iterable, Iterator, Literal, TypeVar

import numpy as np
import sentencepiece as spm
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from nmt.data.corpus import SplitFiles, file_lines, find_splits, read_chunks
from nmt.data.dataset import META_FILE, DataDir, smallest_dtype
from nmt.data.shortlist import save_shortlist
from nmt.data.vocabulary import EOS_ID, UNK_ID, Vocabulary
from nmt.errors import NmtError
from nmt.files import atomic_write, clean_workdirs_beside, fsync_dir
from nmt.log import logger, stderr_console
from nmt.options import check_values
from nmt.version import __version__

LANG_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
NOT_RECORDED = ("destdir", "workers", "force")  # options that never change the output
CHUNK_LINES = 20_000  # pairs read, checked, encoded and written at a time (a few MB of text)
SPM_SEED = 1  # sentencepiece samples --input-sentence-size sentences; a fixed seed makes runs repeatable


@dataclass
class PreprocessOptions:
    """The options of ``nmt preprocess``; field names are the CLI option names (and recipe keys)."""

    source_lang: str = field(metadata={"help": "Source language: the suffix of its files.",
                                       "flags": ["--source-lang", "-s"]})
    target_lang: str = field(metadata={"help": "Target language: the suffix of its files.",
                                       "flags": ["--target-lang", "-t"]})
    destdir: str = field(metadata={"help": "Data directory to write (replaced only once complete)."})
    trainpref: str | None = field(default=None, metadata={
        "help": "Training text: PREFIX.SRC and PREFIX.TGT, plain or .gz."})
    validpref: str | None = field(default=None, metadata={
        "help": "Validation text prefix(es), comma-separated: splits valid, valid1, ..."})
    testpref: str | None = field(default=None, metadata={
        "help": "Test text prefix(es), comma-separated: splits test, test1, ..."})
    joint: bool = field(default=True, metadata={"help": "One sentencepiece model for both languages."})
    vocab_size: int = field(default=37000, metadata={"help": "Sentencepiece vocabulary size (per model).", "min": 1})
    model_type: Literal["bpe", "unigram"] = field(default="bpe", metadata={"help": "Sentencepiece model type."})
    character_coverage: float = field(default=1.0, metadata={
        "help": "Share of characters the vocabulary covers, in (0, 1] (0.9995 for languages with large alphabets).",
        "max": 1.0})
    input_sentence_size: int = field(default=10_000_000, metadata={
        "help": "Sentences sampled to train sentencepiece (0 = all).", "min": 0})
    spm_model: str | None = field(default=None, metadata={
        "help": "Reuse a sentencepiece model instead of training one: PATH, or SRC_PATH,TGT_PATH "
                "(then --joint, --vocab-size and the other training options do not apply)."})
    max_len: int = field(default=250, metadata={
        "help": "Drop training pairs with a side over this many tokens, EOS included (0 = no limit).", "min": 0})
    max_len_ratio: float = field(default=9.0, metadata={
        "help": "Drop training pairs whose longer side has over this many times the tokens of the other "
                "(0 = off, else at least 1).", "min": 0.0})
    workers: int = field(default=1, metadata={
        "help": "Sentencepiece threads encoding the text and training the model.", "min": 1})
    force: bool = field(default=False, metadata={
        "help": "Replace a destdir that holds a different dataset (never a directory that is not one)."})
    byte_fallback: bool = field(default=True, metadata={
        "help": "Train sentencepiece with byte fallback: a character outside the vocabulary is encoded as its "
                "UTF-8 bytes (and decodes back to itself) instead of UNK; the 256 byte pieces count in --vocab-size."})

    def __post_init__(self) -> None:
        check_values(self)
        for option, lang in (("--source-lang", self.source_lang), ("--target-lang", self.target_lang)):
            if not LANG_PATTERN.fullmatch(lang or ""):
                raise NmtError(f"{option} {lang!r} is not a language code (letters, digits, - or _)")
        if self.source_lang == self.target_lang:
            raise NmtError(f"--source-lang and --target-lang are both {self.source_lang!r}")
        if not str(self.destdir).strip():
            raise NmtError("--destdir is empty")
        if not (self.trainpref or self.validpref or self.testpref):
            raise NmtError("nothing to do: give --trainpref, --validpref and/or --testpref")
        if not self.trainpref and not self.spm_model:
            raise NmtError("without --trainpref there is no text to train sentencepiece on; give --spm-model")
        if self.spm_model and len(self.spm_model.split(",")) > 2:
            raise NmtError("--spm-model takes one path (both languages) or two comma-separated paths (source,target)")
        if self.character_coverage <= 0:
            raise NmtError(f"--character-coverage must be in (0, 1], got {self.character_coverage}")
        if 0 < self.max_len_ratio < 1:
            raise NmtError(f"--max-len-ratio must be >= 1 (or 0 = off), got {self.max_len_ratio}")


def preprocess(options: PreprocessOptions, show_progress: bool = True, chunk_lines: int = CHUNK_LINES) -> DataDir:
    """Build (or find up to date) the data directory ``options.destdir`` and open it."""
    splits = find_splits(options.source_lang, options.target_lang, options.trainpref, options.validpref,
                         options.testpref)
    destdir = Path(options.destdir)
    clean_workdirs_beside(destdir)
    recorded = {"options": recorded_options(options), "inputs": fingerprints(splits, options.spm_model)}
    texts = [path for split in splits for path in (split.source, split.target)]
    if is_up_to_date(destdir, recorded, options.force, texts):
        logger.info(f"{destdir} is up to date (same options and input files); nothing to do (--force rebuilds it)")
        return DataDir.open(destdir)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=stderr_console, disable=not show_progress)
    with progress:
        workdir = make_workdir(destdir)  # an unwritable destdir fails before sentencepiece trains
        try:
            train = next((split for split in splits if split.name == "train"), None)
            vocabs = build_vocabularies(options, train, progress)
            write_dataset(workdir, splits, vocabs, options, recorded, progress, chunk_lines)
            replace_directory(workdir, destdir)
        except BaseException as exc:
            shutil.rmtree(workdir, ignore_errors=True)
            if isinstance(exc, OSError):  # disk full, permissions: the user's to fix, not a bug
                raise NmtError(f"cannot write the data directory {destdir}: {exc}") from exc
            raise
    return DataDir.open(destdir)


def make_workdir(destdir: Path) -> Path:
    """An empty directory next to destdir (same filesystem, so the final rename is atomic)."""
    workdir = destdir.parent / f".{destdir.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        destdir.parent.mkdir(parents=True, exist_ok=True)
        workdir.mkdir()
    except OSError as exc:
        raise NmtError(f"cannot create a directory in {destdir.parent}: {exc.strerror or exc}") from exc
    return workdir


def write_dataset(workdir: Path, splits: list[SplitFiles], vocabs: dict[str, Vocabulary], options: PreprocessOptions,
                  recorded: dict, progress: Progress, chunk_lines: int = CHUNK_LINES) -> None:
    """Everything of a data directory into workdir, meta.json last."""
    meta = {"format": 1, "nmt_version": __version__, "source_lang": options.source_lang,
            "target_lang": options.target_lang, **save_vocabularies(workdir, vocabs, options), "splits": {},
            **recorded}
    for split in splits:
        task = progress.add_task(f"encoding {split.name}", total=None)
        advance = lambda lines: progress.advance(task, lines)  # noqa: E731
        meta["splits"][split.name] = binarize_split(workdir, split, vocabs, options, advance, chunk_lines)
        log_split(split.name, meta["splits"][split.name])
    if "train" in meta["splits"]:
        meta["shortlist_file"] = save_shortlist(DataDir(workdir, meta), vocabs)
    DataDir(workdir, meta).write_meta()


def recorded_options(options: PreprocessOptions) -> dict:
    return {k: v for k, v in dataclasses.asdict(options).items() if k not in NOT_RECORDED}


def fingerprints(splits: list[SplitFiles], spm_model: str | None) -> dict[str, dict[str, int]]:
    """Size and mtime of every input file: enough to tell that a finished directory is current."""
    paths = [p for split in splits for p in (split.source, split.target)]
    paths += [Path(p) for p in spm_model.split(",")] if spm_model else []
    result = {}
    for path in paths:
        try:
            stat = path.stat()
        except OSError as exc:
            raise NmtError(f"cannot read {path}: {exc.strerror or exc}") from exc
        result[str(path.resolve())] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return result


def is_up_to_date(destdir: Path, recorded: dict, force: bool, texts: list[Path]) -> bool:
    """True if destdir already holds this very dataset. Only a dataset (another one with force) is
    ever replaced, and never one that holds the text it is made from: replacing deletes the old
    directory (a --spm-model inside it is read before and saved again)."""
    if not destdir.exists():
        return False
    if not destdir.is_dir():
        raise NmtError(f"--destdir {destdir} exists and is not a directory")
    if not any(destdir.iterdir()):
        return False
    if not (destdir / META_FILE).exists():
        raise NmtError(f"--destdir {destdir} already exists and is not a finished nmt dataset (no {META_FILE}); "
                       "choose another --destdir (--force only replaces a dataset)")
    meta = DataDir.open(destdir).meta
    changed = [key for key, value in recorded["options"].items() if meta.get("options", {}).get(key) != value]
    if meta.get("inputs") != recorded["inputs"]:
        changed.append("input files")
    if not changed and not force:
        return True
    inside = [path for path in texts if path.resolve().is_relative_to(destdir.resolve())]
    if inside:
        raise NmtError(f"--destdir {destdir} holds the input {inside[0]}: rebuilding it would delete it; "
                       "move the input out of it or choose another --destdir")
    if force:
        return False
    raise NmtError(f"--destdir {destdir} already holds a different dataset (differs in: {', '.join(changed)}); "
                   "use --force to replace it")


def build_vocabularies(options: PreprocessOptions, train: SplitFiles | None,
                       progress: Progress) -> dict[str, Vocabulary]:
    """One sentencepiece model per language (the same object twice when joint): loaded, or trained on a
    stream of the training text (sentencepiece keeps a sample of --input-sentence-size sentences)."""
    source_lang, target_lang = options.source_lang, options.target_lang
    if options.spm_model:
        paths = options.spm_model.split(",")
        vocabs = [Vocabulary.load(path) for path in paths]
        logger.info(f"using sentencepiece model(s) {options.spm_model} ({', '.join(str(len(v)) for v in vocabs)} "
                    "pieces)")
        return {source_lang: vocabs[0], target_lang: vocabs[-1]}
    assert train is not None
    spm.set_random_generator_seed(SPM_SEED)

    def train_on(paths: list[Path], description: str) -> Vocabulary:
        task = progress.add_task(f"training {options.model_type} {description}", total=None)
        lines = (line for path in paths for line in file_lines(path) if line.strip())
        vocab = Vocabulary.train(lines, options.vocab_size, options.model_type, options.character_coverage,
                                 options.input_sentence_size, num_threads=options.workers,
                                 byte_fallback=options.byte_fallback)
        progress.update(task, total=1, completed=1)
        return vocab

    if options.joint:
        vocab = train_on([train.source, train.target], f"{source_lang}+{target_lang}")
        return {source_lang: vocab, target_lang: vocab}
    return {source_lang: train_on([train.source], source_lang), target_lang: train_on([train.target], target_lang)}


def save_vocabularies(workdir: Path, vocabs: dict[str, Vocabulary], options: PreprocessOptions) -> dict:
    """Write spm.model (shared) or spm.{lang}.model and return the meta.json entries describing them."""
    source, target = vocabs[options.source_lang], vocabs[options.target_lang]
    joint = source == target
    files = {lang: "spm.model" if joint else f"spm.{lang}.model" for lang in vocabs}
    for filename, vocab in {files[lang]: vocab for lang, vocab in vocabs.items()}.items():
        vocab.save(workdir / filename)
    return {"joint": joint, "vocab_files": files,
            "vocab_sizes": {lang: len(vocab) for lang, vocab in vocabs.items()},
            "spm_sha256": {lang: vocab.sha256 for lang, vocab in vocabs.items()}}


@dataclass
class EncodedSide:
    """One side of a chunk as flat token ids (no EOS yet) and per-sentence lengths."""

    tokens: np.ndarray
    lengths: np.ndarray


def encode_lines(vocab: Vocabulary, lines: list[str], threads: int = 1) -> EncodedSide:
    """Encode straight into a compact numpy array (Python lists of ids would take ~20x the RAM)."""
    ids = vocab.encode_batch(lines, num_threads=threads)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    tokens = np.fromiter(chain.from_iterable(ids), dtype=smallest_dtype(len(vocab)), count=int(lengths.sum()))
    return EncodedSide(tokens, lengths)


Item = TypeVar("Item")
Result = TypeVar("Result")


def ordered_map(function: Callable[[Item], Result], items: Iterable[Item], pool: Executor,
                ahead: int) -> Iterator[Result]:
    """``map`` in a pool, in order, with at most ``ahead`` items in flight (bounded memory)."""
    pending: collections.deque = collections.deque()
    try:
        for item in items:
            pending.append(pool.submit(function, item))
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()


def encoded_chunks(split: SplitFiles, vocabs: tuple[Vocabulary, Vocabulary], workers: int,
                   chunk_lines: int) -> Iterator[tuple[EncodedSide, EncodedSide]]:
    """The split's chunks of pairs, read and checked here and encoded by sentencepiece's own
    ``workers`` threads in a second thread, so the next chunk is read while one is encoded (no
    processes: the text and the ids never have to be copied between them)."""

    def encode(chunk: tuple[list[str], list[str]]) -> tuple[EncodedSide, EncodedSide]:
        return encode_lines(vocabs[0], chunk[0], workers), encode_lines(vocabs[1], chunk[1], workers)

    with ThreadPoolExecutor(1) as pool:
        yield from ordered_map(encode, read_chunks(split, chunk_lines), pool, ahead=2)


def drop_reasons(source_lengths: np.ndarray, target_lengths: np.ndarray, max_len: int,
                 max_len_ratio: float) -> dict[str, np.ndarray]:
    """Masks of the training pairs to drop, each pair under its first reason only."""
    source_sizes, target_sizes = source_lengths + 1, target_lengths + 1  # as stored, with EOS
    empty = (source_lengths == 0) | (target_lengths == 0)
    never = np.zeros_like(empty)
    too_long = ~empty & ((source_sizes > max_len) | (target_sizes > max_len)) if max_len else never
    longer, shorter = np.maximum(source_sizes, target_sizes), np.minimum(source_sizes, target_sizes)
    ratio = ~empty & ~too_long & (longer > max_len_ratio * shorter) if max_len_ratio else never
    return {"empty": empty, "too_long": too_long, "ratio": ratio}


def with_eos(side: EncodedSide, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kept sentences as stored: flat tokens each followed by EOS, and n+1 offsets."""
    offsets = np.zeros(int(keep.sum()) + 1, dtype=np.int64)
    np.cumsum(side.lengths[keep] + 1, out=offsets[1:])
    tokens = np.full(int(offsets[-1]), EOS_ID, dtype=side.tokens.dtype)
    body = np.ones(len(tokens), dtype=bool)
    body[offsets[1:] - 1] = False
    tokens[body] = side.tokens[np.repeat(keep, side.lengths)]
    return tokens, offsets


class TokenFileWriter:
    """One side of a split written as it is encoded: ``{prefix}.tokens.npy``, then ``{prefix}.offsets.npy``.

    The .npy header holds the array's length, known only at the end. numpy leaves room in every
    header for the length to grow (as for appending to a file), so the header is written for
    length 0 first and rewritten in place, with the same size, when the file is complete.
    """

    def __init__(self, prefix: Path, dtype: np.dtype):
        self.prefix, self.dtype = prefix, dtype
        self.handle = open(f"{prefix}.tokens.npy", "wb")
        self.header_size = self.handle.write(npy_header(dtype, 0))
        self.lengths: list[np.ndarray] = []  # per chunk, EOS included
        self.num_tokens = self.num_unk = 0

    def append(self, side: EncodedSide, keep: np.ndarray) -> None:
        tokens, offsets = with_eos(side, keep)
        self.handle.write(tokens.astype(self.dtype, copy=False).tobytes())
        self.lengths.append(np.diff(offsets).astype(np.int32))
        self.num_tokens += len(tokens)
        self.num_unk += int(np.count_nonzero(tokens == UNK_ID))

    def close(self) -> None:
        header = npy_header(self.dtype, self.num_tokens)
        assert len(header) == self.header_size, "numpy's .npy header no longer leaves room for the length"
        self.handle.seek(0)
        self.handle.write(header)
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.int32)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        with atomic_write(f"{self.prefix}.offsets.npy", "wb") as handle:
            np.save(handle, offsets)


def npy_header(dtype: np.dtype, length: int) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                  "fortran_order": False, "shape": (length,)})
    return buffer.getvalue()


def binarize_split(workdir: Path, split: SplitFiles, vocabs: dict[str, Vocabulary], options: PreprocessOptions,
                   advance: Callable[[int], None], chunk_lines: int = CHUNK_LINES) -> dict:
    """Stream one split: read, check, encode, filter (train only) and write it; return its meta.json entry."""
    langs = (options.source_lang, options.target_lang)
    writers = [TokenFileWriter(workdir / f"{split.name}.{lang}", smallest_dtype(len(vocabs[lang]))) for lang in langs]
    dropped = dict.fromkeys(("empty", "too_long", "ratio"), 0)
    input_lines = 0
    try:
        for sides in encoded_chunks(split, (vocabs[langs[0]], vocabs[langs[1]]), options.workers, chunk_lines):
            keep = np.ones(len(sides[0].lengths), dtype=bool)
            if not split.keeps_every_line:
                reasons = drop_reasons(sides[0].lengths, sides[1].lengths, options.max_len, options.max_len_ratio)
                for reason, mask in reasons.items():
                    keep &= ~mask
                    dropped[reason] += int(mask.sum())
            for writer, side in zip(writers, sides):
                writer.append(side, keep)
            input_lines += len(keep)
            advance(len(keep))
    except BaseException:
        for writer in writers:
            writer.handle.close()  # the caller deletes the workdir
        raise
    for writer in writers:
        writer.close()
    entry: dict = {"sentences": sum(map(len, writers[0].lengths)), "input_lines": input_lines,
                   "source_file": str(split.source.resolve()), "target_file": str(split.target.resolve())}  # any cwd
    if not split.keeps_every_line:
        entry["dropped"] = dropped
        if entry["sentences"] == 0:
            raise NmtError(f"all training pairs were dropped ({format_dropped(dropped)}); "
                           "check --max-len and --max-len-ratio")
    for role, writer in zip(("source", "target"), writers):
        entry[f"{role}_tokens"] = writer.num_tokens
        entry[f"{role}_unk"] = writer.num_unk
    return entry


def replace_directory(new: Path, destdir: Path) -> None:
    """Rename the finished ``new`` to ``destdir``; an old destdir is moved aside first and deleted last."""
    old = None
    if destdir.exists():
        old = destdir.parent / f".{destdir.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(destdir, old)
    try:
        os.rename(new, destdir)
    except BaseException:
        if old is not None:
            os.rename(old, destdir)
        raise
    fsync_dir(destdir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def format_dropped(dropped: dict[str, int]) -> str:
    """E.g. "12: empty 3, too long 9" (only the reasons that dropped something)."""
    reasons = ", ".join(f"{reason.replace('_', ' ')} {count:,}" for reason, count in dropped.items() if count)
    return f"{sum(dropped.values()):,}" + (f": {reasons}" if reasons else "")


def unk_rate(entry: dict, role: str) -> float:
    """Share of UNK among the real tokens (the EOS of each sentence not counted)."""
    real = entry[f"{role}_tokens"] - entry["sentences"]
    return entry[f"{role}_unk"] / real if real else 0.0


def log_split(name: str, entry: dict) -> None:
    dropped = f", dropped {format_dropped(entry['dropped'])}" if "dropped" in entry else ""
    logger.info(f"{name}: {entry['sentences']} pairs, {entry['source_tokens']} + {entry['target_tokens']} tokens"
                f"{dropped}", extra={"fields": {"split": name, **entry}})


def summary_table(datadir: DataDir) -> Table:
    """Sentences, tokens (EOS included), unknown-token rate and dropped pairs per split."""
    source, target = datadir.source_lang, datadir.target_lang
    table = Table(title=f"{datadir.path}  ({source}-{target}, vocab "
                        f"{'/'.join(str(n) for n in dict.fromkeys(datadir.meta['vocab_sizes'].values()))}"
                        f"{', joint' if datadir.meta['joint'] else ''})")
    for column in ("split", "sentences", f"{source} tokens", f"{target} tokens", f"{source} unk", f"{target} unk"):
        table.add_column(column, justify="left" if column == "split" else "right")
    table.add_column("dropped")
    for name, entry in datadir.meta["splits"].items():
        dropped = entry.get("dropped")
        table.add_row(name, f"{entry['sentences']:,}", f"{entry['source_tokens']:,}", f"{entry['target_tokens']:,}",
                      f"{unk_rate(entry, 'source'):.3%}", f"{unk_rate(entry, 'target'):.3%}",
                      format_dropped(dropped) if dropped is not None else "-")
    return table
