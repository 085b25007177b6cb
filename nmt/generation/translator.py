"""The Python API: load a checkpoint once, then translate lists of sentences.

    from nmt import Translator

    translator = Translator.from_checkpoint("checkpoints/checkpoint_best.pt")
    translator.translate(["A man is riding a bike."])           # ['Ein Mann fährt Fahrrad.']
    translator.hypotheses(["A dog."], beam=5, nbest=2)           # scores and per-token scores
    translator.translate(["A man is riding a bike."], prefixes=["Ein Mann"], constraints=[["Fahrrad"]],
                         bans=["Rad"])                           # controls: see nmt/generation/constraints.py

Everything goes through the functions ``nmt generate`` uses (loading, encoding, length-sorted
batches, beam search), with its defaults, so a sentence translates the same either way.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nmt.checkpoint.format import Vocabularies
from nmt.device import inference_device
from nmt.device_options import InferenceDeviceOptions
from nmt.errors import NmtError
from nmt.generation.control_input import controls_from_lists
from nmt.generation.decoding_settings import DecodingSettings, decoding_settings, stop_for
from nmt.generation.inference import TranslationRequest, encode_sources, prepare_model, translate_ids
from nmt.generation.options import BatchingOptions, SearchOptions
from nmt.generation.search import Hypothesis
from nmt.generation.workers import KeptWorkers
from nmt.log import logger
from nmt.options import build, options_of

# What a call may change: the search and the batching. Loading options belong to from_checkpoint.
CALL_OPTIONS = tuple(options_of(SearchOptions)) + tuple(options_of(BatchingOptions))


@dataclass
class ScoredTranslation:
    text: str  # detokenized
    score: float  # length-normalized log-probability (natural log), as `nmt generate --print-scores`
    pieces: list[str]  # the sentencepiece pieces, without EOS
    token_scores: list[float]  # log-probability of each piece, then of EOS


@dataclass
class Translator:
    model: nn.Module  # one model, or an Ensemble of several
    vocabs: Vocabularies
    device: torch.device
    precision: str
    decoding: DecodingSettings  # the quantization, and the stop rule of a call's stop="auto" (the default)
    path: str  # the checkpoint(s), ':'-separated for an ensemble
    # Its forked decoding workers, kept from call to call (nmt/generation/workers.py) until close() or
    # the program's end: they decode with the model as it was at their fork.
    kept_workers: KeptWorkers = field(default_factory=KeptWorkers, init=False, repr=False, compare=False)

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str = "auto", precision: str = "auto",
                        quantize: str | None = "auto", backend: str = "auto") -> Translator:
        """Load a checkpoint (``a.pt:b.pt`` for an ensemble) for ``device`` (auto, cpu, cuda, cuda:N);
        ``quantize`` and the calls' ``stop`` default to auto, as `nmt generate`'s (``quantize=None``,
        the default before auto, is none); ``backend``: as `nmt generate --backend`.

        The process's allocator and environment are left as they are (`nmt generate` tunes its own:
        ``nmt.tune_for_decoding`` does the same here, called first)."""
        compute = build(InferenceDeviceOptions, {"device": device, "precision": precision,
                                                 "quantize": quantize or "none", "backend": backend})
        settings = decoding_settings(compute, None, str(path))  # each call's search takes its stop rule or not
        compute = dataclasses.replace(compute, quantize=settings.quantize)
        resolved, precision, reason = inference_device(compute)
        logger.debug("precision: %s (%s); %s", precision, reason, settings.describe())
        model, vocabs = prepare_model(str(path), resolved, compute.quantize, compute.backend)
        return cls(model, vocabs, resolved, precision, settings, str(path))

    def close(self) -> None:
        """End its forked decoding workers now (a later call forks new ones); without it they end with
        the program. ``with Translator.from_checkpoint(...) as t:`` closes it at the block's end."""
        self.kept_workers.close()

    def __enter__(self) -> Translator:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def options(self, **overrides: Any) -> tuple[SearchOptions, BatchingOptions]:
        """``nmt generate``'s search and batching options, with the given ones changed (and checked)."""
        unknown = sorted(set(overrides) - set(CALL_OPTIONS))
        if unknown:
            raise NmtError(f"unknown translation option(s) {', '.join(unknown)}; known: {', '.join(CALL_OPTIONS)}")
        search = build(SearchOptions, {k: v for k, v in overrides.items() if k in options_of(SearchOptions)})
        search = dataclasses.replace(search, stop=stop_for(search, self.decoding))
        batching = build(BatchingOptions, {k: v for k, v in overrides.items() if k in options_of(BatchingOptions)})
        return search, batching

    def hypotheses(self, sentences: list[str], prefixes: list[str | None] | None = None,
                   constraints: list[list[str] | None] | None = None, bans: list[str] | None = None,
                   **options: Any) -> list[list[ScoredTranslation]]:
        """The ``nbest`` translations of each sentence, best first, with their scores.

        Controls: ``prefixes`` one target prefix (or None) per sentence, which each translation
        begins with (its score is the continuation's); ``constraints`` one list of target phrases per
        sentence, which the translation must contain; ``bans`` target phrases no translation contains."""
        if isinstance(sentences, str):
            raise NmtError("translate a list of strings (one sentence each), not a single string")
        sentences = list(sentences)  # any iterable: a generator or a file is read once, here
        if not all(isinstance(s, str) for s in sentences):
            raise NmtError("translate a list of strings (one sentence each)")
        search, batching = self.options(**options)
        controls = controls_from_lists(self.vocabs.target, len(sentences), prefixes, constraints, bans)
        found = translate_ids(self.model, encode_sources(self.vocabs, sentences),
                              self.request(search, batching, controls=controls, kept_workers=self.kept_workers,
                                           fork_workers=threading.active_count() == 1))  # no thread holds a lock
        return [[self.scored(h) for h in hyps] for hyps in found]

    def request(self, search: SearchOptions, batching: BatchingOptions, **more: Any) -> TranslationRequest:
        """What ``translate_ids`` needs to translate with this model: ``search`` (its stop resolved, as
        ``options`` gives it) and ``batching`` on its device, precision and shortlist, and ``more``."""
        return TranslationRequest(search, batching, self.device, self.precision, shortlist=self.vocabs.shortlist,
                                  **more)

    def translate(self, sentences: list[str], prefixes: list[str | None] | None = None,
                  constraints: list[list[str] | None] | None = None, bans: list[str] | None = None,
                  **options: Any) -> list[str]:
        """The best translation of each sentence. Options: beam=4, lenpen=0.6, nbest=1, ... (`nmt generate`'s);
        controls as ``hypotheses``."""
        return [hyps[0].text for hyps in self.hypotheses(sentences, prefixes, constraints, bans, **options)]

    def scored(self, hypothesis: Hypothesis) -> ScoredTranslation:
        target = self.vocabs.target
        return ScoredTranslation(target.decode(hypothesis.tokens), hypothesis.score,
                                 [target.piece(i) for i in hypothesis.tokens[:-1]], list(hypothesis.positional_scores))
