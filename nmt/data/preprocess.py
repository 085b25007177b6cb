"""``nmt preprocess``: raw parallel text -> sentencepiece model(s) + binarized splits + meta.json.

Every input file is found first (nmt/data/corpus.py). The text is then streamed, never held
whole: sentencepiece trains on a stream of the training text, keeping a sample of at most
``input_sentence_size`` sentences (spm_training.py); each split is read in chunks of pairs,
checked as it goes (UTF-8, line counts, empty lines, with the file and line), encoded by
``workers`` sentencepiece threads while the next chunk is read, and appended to its token file
(binarize.py, token_file.py). Only compact numpy arrays (a length per sentence) grow with the
corpus. Everything is written into a temporary directory next to ``destdir`` that is renamed into
place at the end (``atomic_directory``), meta.json last (meta.py): bad input found late, a crash or
Ctrl-C never leaves a ``destdir`` that DataDir.open accepts. (A run killed outright may leave a
hidden ``.NAME.tmp-*`` directory beside it, which the next run removes.)

Running again with the same options and unchanged input files (same content) does nothing
and says the directory is up to date (up_to_date.py); ``force`` rebuilds it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from nmt.data.binarize import Sampling, binarize_split
from nmt.data.corpus import SplitFiles, find_splits
from nmt.data.dataset import DataDir, sample_name
from nmt.data.meta import DatasetMeta
from nmt.data.shortlist import SHORTLIST_FILE, learn_shortlist
from nmt.data.spm_training import build_vocabularies, save_vocabularies
from nmt.data.summary import log_split
from nmt.data.up_to_date import fingerprints, is_up_to_date
from nmt.data.vocabulary import Vocabularies
from nmt.errors import NmtError
from nmt.files import atomic_directory, clean_workdirs_beside
from nmt.log import logger, stderr_console
from nmt.options import check_values
from nmt.version import __version__

LANG_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
NOT_RECORDED = ("destdir", "workers", "force")  # options that never change the output
CHUNK_LINES = 20_000  # pairs read, checked, encoded and written at a time (a few MB of text)


@dataclass
class PreprocessOptions:
    """The options of ``nmt preprocess``; field names are the CLI option names (and recipe keys)."""

    source_lang: str = field(metadata={"help": "Source language: the suffix of its files.",
                                       "flags": ["--source-lang", "-s"]})
    target_lang: str = field(metadata={"help": "Target language: the suffix of its files.",
                                       "flags": ["--target-lang", "-t"]})
    destdir: str = field(metadata={"path": True, "help": "Data directory to write (replaced only once complete)."})
    trainpref: str | None = field(default=None, metadata={"path": True,
        "help": "Training text: PREFIX.SRC and PREFIX.TGT, plain or .gz."})
    validpref: str | None = field(default=None, metadata={"path": True,
        "help": "Validation text prefix(es), comma-separated: splits valid, valid1, ..."})
    testpref: str | None = field(default=None, metadata={"path": True,
        "help": "Test text prefix(es), comma-separated: splits test, test1, ..."})
    joint: bool = field(default=True, metadata={"help": "One sentencepiece model for both languages."})
    vocab_size: int = field(default=37000, metadata={"help": "Sentencepiece vocabulary size (per model).", "min": 1})
    model_type: Literal["bpe", "unigram"] = field(default="bpe", metadata={"help": "Sentencepiece model type."})
    character_coverage: float = field(default=1.0, metadata={
        "help": "Share of characters the vocabulary covers, in (0, 1] (0.9995 for languages with large alphabets).",
        "max": 1.0})
    input_sentence_size: int = field(default=10_000_000, metadata={
        "help": "Sentences sampled to train sentencepiece (0 = all).", "min": 0})
    spm_model: str | None = field(default=None, metadata={"path": True,
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
    subword_samples: int = field(default=0, metadata={
        "help": "Also write N segmentations of the training text sampled by sentencepiece (BPE-dropout for a bpe "
                "model, subword regularization for a unigram one); training reads one an epoch, in turn, instead of "
                "train: a regularizer for small corpora. Each is filtered by --max-len and --max-len-ratio on its "
                "own lengths. Costs N times train's disk space, its encoding time on one thread (so that the seed "
                "decides the samples) and its batch lists in training's memory.",
        "min": 0})
    subword_alpha: float = field(default=0.1, metadata={
        "help": "The sampling's alpha for --subword-samples, in (0, 1): the probability of dropping a merge (bpe), "
                "or the smoothing of the segmentations' distribution (unigram)."})

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
        if not 0 < self.subword_alpha < 1:
            raise NmtError(f"--subword-alpha must be in (0, 1), got {self.subword_alpha}")
        if self.subword_samples and not self.trainpref:
            raise NmtError("--subword-samples samples the training text: give --trainpref")
        if 0 < self.max_len_ratio < 1:
            raise NmtError(f"--max-len-ratio must be >= 1 (or 0 = off), got {self.max_len_ratio}")


def preprocess(options: PreprocessOptions, show_progress: bool = True, chunk_lines: int = CHUNK_LINES) -> DataDir:
    """Build (or find up to date) the data directory ``options.destdir`` and open it."""
    splits = find_splits(options.source_lang, options.target_lang, options.trainpref, options.validpref,
                         options.testpref)
    destdir = Path(options.destdir)
    clean_workdirs_beside(destdir)
    recorded, inputs = recorded_options(options), fingerprints(splits, options.spm_model)
    texts = [path for split in splits for path in (split.source, split.target)]
    if is_up_to_date(destdir, recorded, inputs, options.force, texts, path_keys=PATH_OPTIONS):
        logger.info(f"{destdir} is up to date (same options and input files); nothing to do (--force rebuilds it)")
        return DataDir.open(destdir)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=stderr_console, disable=not show_progress)
    try:
        with progress, atomic_directory(destdir) as workdir:  # an unwritable destdir fails before sentencepiece trains
            train = next((split for split in splits if split.name == "train"), None)
            vocabs = build_vocabularies(options, train, progress)
            write_dataset(workdir, splits, vocabs, options, inputs, progress, chunk_lines)
    except OSError as exc:  # disk full, permissions: the user's to fix, not a bug
        raise NmtError(f"cannot write the data directory {destdir}: {exc}") from exc
    return DataDir.open(destdir)


PATH_OPTIONS = [f.name for f in dataclasses.fields(PreprocessOptions) if f.metadata.get("path")]


def recorded_options(options: PreprocessOptions) -> dict[str, Any]:
    """The options that shape the output (the sampling's only where it samples: directories from before have none)."""
    unused = () if options.subword_samples else ("subword_samples", "subword_alpha")
    return {k: v for k, v in dataclasses.asdict(options).items() if k not in (*NOT_RECORDED, *unused)}


def write_dataset(workdir: Path, splits: list[SplitFiles], vocabs: Vocabularies, options: PreprocessOptions,
                  inputs: dict[str, dict[str, int | str]], progress: Progress, chunk_lines: int = CHUNK_LINES) -> None:
    """Everything of a data directory into workdir, meta.json last."""
    languages = {vocabs.source_lang: vocabs.source, vocabs.target_lang: vocabs.target}
    meta = DatasetMeta(options.source_lang, options.target_lang, vocab_files=save_vocabularies(workdir, vocabs),
                       splits={}, vocab_sizes={lang: len(vocab) for lang, vocab in languages.items()},
                       spm_sha256={lang: vocab.sha256 for lang, vocab in languages.items()},
                       options=recorded_options(options), inputs=inputs, nmt_version=__version__)
    for split in splits:
        task = progress.add_task(f"encoding {split.name}", total=None)
        advance = lambda lines: progress.advance(task, lines)  # noqa: E731
        meta.splits[split.name] = binarize_split(workdir, split, vocabs, options, advance, chunk_lines)
        log_split(split.name, meta.splits[split.name])
    train = next((split for split in splits if split.name == "train"), None)
    if train and options.subword_samples:
        task = progress.add_task(f"sampling train x{options.subword_samples}", total=None)
        for number in range(1, options.subword_samples + 1):
            name = sample_name(train.name, number)
            meta.samples[name] = binarize_split(workdir, train, vocabs, options,
                                                lambda lines: progress.advance(task, lines), chunk_lines,
                                                Sampling(options.subword_alpha, seed=number), name=name)
        train_tokens = meta.splits["train"].source_tokens + meta.splits["train"].target_tokens
        logger.info(f"train sampled {options.subword_samples} times (alpha {options.subword_alpha}): "
                    f"{meta.sample_tokens()} tokens against {train_tokens:,}")
    if "train" in meta.splits:
        meta.shortlist_file = save_shortlist(DataDir(workdir, meta), vocabs)
    meta.save(workdir)


def save_shortlist(data: DataDir, vocabs: Vocabularies) -> str:
    """Learn the shortlist of a data directory's train split and save it there; returns its file name."""
    train, source, target = data.split("train"), vocabs.source, vocabs.target
    shortlist = learn_shortlist((train.source.tokens, train.source.offsets),
                                (train.target.tokens, train.target.offsets), len(source), len(target),
                                joint=source == target)
    shortlist.save(data.path / SHORTLIST_FILE)
    logger.info("vocabulary shortlist: %d target candidates per source piece and %d frequent ones",
                shortlist.translations.shape[1], len(shortlist.frequent))
    return SHORTLIST_FILE
