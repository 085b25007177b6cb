"""The sentencepiece model(s) of a data directory: reused (``--spm-model``), or trained on a stream
of the training text, one joint model or one per language; saved beside the binarized splits."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import sentencepiece as spm
from rich.progress import Progress

from nmt.data.corpus import SplitFiles, file_lines
from nmt.data.vocabulary import Vocabularies, Vocabulary
from nmt.log import logger

SPM_SEED = 1  # sentencepiece samples --input-sentence-size sentences; a fixed seed makes runs repeatable


class SentencepieceSettings(Protocol):
    """What building the vocabularies reads of PreprocessOptions."""

    source_lang: str
    target_lang: str
    spm_model: str | None
    joint: bool
    vocab_size: int
    model_type: str
    character_coverage: float
    input_sentence_size: int
    byte_fallback: bool
    workers: int


def build_vocabularies(options: SentencepieceSettings, train: SplitFiles | None, progress: Progress) -> Vocabularies:
    """One sentencepiece model per language (the same object twice when joint): loaded, or trained on a
    stream of the training text (sentencepiece keeps a sample of --input-sentence-size sentences)."""
    source_lang, target_lang = options.source_lang, options.target_lang
    if options.spm_model:
        vocabs = [Vocabulary.load(path) for path in options.spm_model.split(",")]
        logger.info(f"using sentencepiece model(s) {options.spm_model} ({', '.join(str(len(v)) for v in vocabs)} "
                    "pieces)")
        return Vocabularies(source_lang, target_lang, vocabs[0], vocabs[-1])
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
        return Vocabularies(source_lang, target_lang, vocab, vocab)
    return Vocabularies(source_lang, target_lang, train_on([train.source], source_lang),
                        train_on([train.target], target_lang))


def save_vocabularies(workdir: Path, vocabs: Vocabularies) -> dict[str, str]:
    """Write spm.model (joint) or spm.{lang}.model; return each language's file name."""
    files = {lang: "spm.model" if vocabs.joint else f"spm.{lang}.model"
             for lang in (vocabs.source_lang, vocabs.target_lang)}
    vocabs.source.save(workdir / files[vocabs.source_lang])
    if not vocabs.joint:
        vocabs.target.save(workdir / files[vocabs.target_lang])
    return files
