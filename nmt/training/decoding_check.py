"""Which fast decoding settings keep a model's BLEU: a check on its validation set, recorded in the
checkpoint for ``--quantize auto`` and ``--stop auto`` (nmt/generation/decoding_settings.py).

int8 dynamic quantization (1.35x bf16's speed and 1.9x fp32's on a Zen 4), ``--stop finished``
(about 1.3x at length penalty 0.6, 1.6x at 1.4) and ``--stop current`` (about as fast; at a large
length penalty it kept BLEU where finished did not) usually keep BLEU, but not always. The end of
`nmt train` and `nmt average` decode the validation set with the reference setting (fp32, exact
search) and the faster ones, and store the fastest that kept BLEU under the checkpoint's
``decoding`` key (a plain dict), with the search it decoded with (beam, length penalty and
limits: --check-beam, --check-lenpen, ...; a recipe's are its generate stage's), for which alone
``--stop auto`` takes the choice.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from nmt.checkpoint.format import load_checkpoint, model_from_checkpoint, save_checkpoint
from nmt.data.dataset import DataDir, ParallelDataset
from nmt.data.vocabulary import Vocabularies
from nmt.device import resolve_device, resolve_precision
from nmt.device_options import BLEU_TOLERANCE
from nmt.errors import NmtError
from nmt.generation.decoding_settings import RECORD_KEY, DecodingSettings, describe_search
from nmt.generation.inference import TranslationRequest, choose_backend, inference_model, translate_ids
from nmt.generation.options import SearchOptions
from nmt.log import logger
from nmt.scoring import MetricOptions, score
from nmt.training.config import subset_names

# The settings compare on the same sentences, so what decides is their difference, not BLEU's
# sampling noise; 500 sentences (about 10,000 words: half of Multi30k's validation set, a sixth of
# a WMT newstest) show a truncation habit such as the demo's and keep the check's four decodings
# short next to training.
CHECK_SENTENCES = 500
# On fewer sentences the tolerance (0.2 BLEU) is a word or two: the check is skipped and the model
# decodes as an unchecked one does.
MIN_CHECK_SENTENCES = 100


class TooFewSentences(NmtError):
    """A validation split too small for the check: a normal case (a small corpus), not a fault."""


REFERENCE = DecodingSettings("none", "exact")
CANDIDATES = (DecodingSettings("int8", "finished"), DecodingSettings("int8", "current"),
              DecodingSettings("int8", "exact"), DecodingSettings("none", "finished"),
              DecodingSettings("none", "current"))  # fastest first


def choose_decoding(reference: float, scored: Iterable[tuple[DecodingSettings, float]], sentences: int,
                    note: str = "", precision: str = "fp32") -> DecodingSettings:
    """The first of ``scored`` (fastest first, consumed only as far as needed) whose BLEU is within
    BLEU_TOLERANCE of the ``reference`` setting's; none of them: the reference setting. Either with
    the check's figures as its reason, the settings without int8 named by the ``precision`` they
    were decoded in."""
    seen = [f"{REFERENCE.name()} {reference:.2f}"]
    for setting, bleu in scored:
        name = setting.name(precision)
        seen.append(f"{name} {bleu:.2f}")
        if bleu >= reference - BLEU_TOLERANCE:
            return dataclasses.replace(setting, reason=check_reason(sentences, seen, f"{name} kept it", note))
    return dataclasses.replace(REFERENCE, reason=check_reason(sentences, seen, "no faster setting kept it", note))


def check_reason(sentences: int, seen: list[str], verdict: str, note: str) -> str:
    return (f"validation check, {sentences} sentences: {', '.join(seen)} BLEU: {verdict} "
            f"(within {BLEU_TOLERANCE}){note}")


def check_decoding(checkpoint: dict[str, Any] | str | Path, sources: Sequence[np.ndarray],
                   references: Sequence[np.ndarray], device: torch.device,
                   search: SearchOptions | None = None) -> DecodingSettings:
    """Decode the first CHECK_SENTENCES sources (token ids ending in EOS) with the reference setting
    (fp32, exact search) and the faster candidates, fastest first, and choose by corpus BLEU against
    ``references`` (both sides detokenized by the target vocabulary). The search is ``search``'s
    beam, length penalty and limits (None: `nmt generate`'s defaults), recorded with the choice; the
    shortlist is generate's default on ``device`` (on a GPU: none); int8 is tried on the CPU only
    (it computes in fp32); the candidates without it in the precision `auto` resolves to on
    ``device``, as `nmt generate` will decode them (bf16 where the hardware computes it natively)."""
    search = search or SearchOptions()
    checkpoint = checkpoint if isinstance(checkpoint, dict) else load_checkpoint(checkpoint)
    sources, references = list(sources[:CHECK_SENTENCES]), list(references[:CHECK_SENTENCES])
    if not sources or len(sources) != len(references):
        raise NmtError(f"the decoding check needs sources and references, one for one; got {len(sources)} and "
                       f"{len(references)}")
    if len(sources) < MIN_CHECK_SENTENCES:
        raise TooFewSentences(f"{len(sources)} validation sentences, fewer than the {MIN_CHECK_SENTENCES} the check "
                              f"needs to tell {BLEU_TOLERANCE} BLEU from a word or two")
    vocabs = Vocabularies.from_state(checkpoint["vocab"])
    precision = resolve_precision("auto", device)[0]
    decoded_references = [vocabs.target.decode(reference) for reference in references]
    models: dict[str, nn.Module] = {}  # by quantize: the float model serves the reference and the others without int8

    def bleu(setting: DecodingSettings) -> float:
        if setting.quantize not in models:
            model = model_from_checkpoint(checkpoint)[0]  # afresh: int8 changes the model it quantizes
            backend = choose_backend(device, setting.quantize)
            models[setting.quantize] = inference_model(model, setting.quantize, backend).to(device)
        in_fp32 = setting == REFERENCE or setting.quantize == "int8"
        request = TranslationRequest(dataclasses.replace(search, stop=setting.stop), device=device,
                                     precision="fp32" if in_fp32 else precision, shortlist=vocabs.shortlist)
        found = translate_ids(models[setting.quantize], sources, request)
        hypotheses = [vocabs.target.decode(hyps[0].tokens) for hyps in found]
        return score(hypotheses, [decoded_references], options=MetricOptions(language=vocabs.target_lang))[0].score

    candidates = [setting for setting in CANDIDATES if (setting.quantize == "none" or device.type == "cpu")
                  and (setting.stop != "current" or search.lenpen > 0)]  # else current searches as exact does
    note = "" if device.type == "cpu" else f"; int8 not tried on {device.type}"
    choice = choose_decoding(bleu(REFERENCE), ((setting, bleu(setting)) for setting in candidates), len(sources), note,
                             precision)
    return dataclasses.replace(choice, search=search.checked())


def first_pairs(dataset: ParallelDataset, indices: Iterable[int], max_positions: int | None
                ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The sources and references of the first CHECK_SENTENCES ``indices`` whose source fits the model."""
    sources, references = [], []
    for index in indices:
        source = dataset.source[index]
        if max_positions is None or len(source) <= max_positions:
            sources.append(source)
            references.append(dataset.target[index])
            if len(sources) == CHECK_SENTENCES:
                break
    return sources, references


def save_with_record(path: str | Path, checkpoint: dict[str, Any], choice: DecodingSettings | None) -> None:
    """Write ``checkpoint`` again to ``path`` with the check's choice (none: the file stays as it is)."""
    if choice is not None:
        checkpoint[RECORD_KEY] = choice.to_dict()
        save_checkpoint(path, checkpoint)


SKIPPED = "decoding check of %s skipped: %s (--quantize auto and --stop auto will decode it with none and exact)"


def timed_check(checkpoint: dict[str, Any], sources: Sequence[np.ndarray], references: Sequence[np.ndarray],
                device: torch.device, name: str, search: SearchOptions | None = None) -> DecodingSettings | None:
    """``check_decoding``, with one log line of its choice and its cost; one saying why when it cannot
    run (too few sentences to decode, a BLEU tokenizer missing here), which leaves the model
    unchecked rather than failing the training or averaging that asked for it. A small validation
    split is a normal case, said at the info level; the others are warnings."""
    started = time.perf_counter()
    try:
        choice = check_decoding(checkpoint, sources, references, device, search)
    except TooFewSentences as exc:
        logger.info(SKIPPED, name, exc)
        return None
    except NmtError as exc:
        logger.warning(SKIPPED, name, exc)
        return None
    logger.info("decoding check of %s: quantize %s, stop %s, in %.1f s on %s, searching with %s (%s)", name,
                choice.quantize, choice.stop, time.perf_counter() - started, device,
                describe_search(choice.checked_search()), choice.reason)
    return choice


def check_with_training_data(checkpoint: dict[str, Any], train_config: dict[str, Any] | None,
                             name: str, search: SearchOptions | None = None) -> DecodingSettings | None:
    """The check on the validation split the run that made ``checkpoint`` validated on (its
    ``train_config``), on the device `nmt generate` would take by default; None, with one log line
    saying why, when that data cannot be found here."""
    train = (train_config or {}).get("train", {})
    data, splits = train.get("data"), subset_names(train.get("valid_subset"))
    skipped = None
    if not data or not splits:
        skipped = "the checkpoints do not name the data directory and split their training validated on"
    elif not (Path(data) / "meta.json").is_file():
        skipped = f"the training's data directory {data} is not here"
    else:
        datadir = DataDir.open(data)
        vocabs = Vocabularies.from_state(checkpoint["vocab"])
        if splits[0] not in datadir.splits:
            skipped = f"{data} has no split {splits[0]!r}"
        elif datadir.vocabulary(datadir.target_lang) != vocabs.target or \
                datadir.vocabulary(datadir.source_lang) != vocabs.source:
            skipped = f"{data} now holds other vocabularies than the checkpoints'"
    if skipped:
        logger.info(SKIPPED, name, skipped)
        return None
    dataset = datadir.split(splits[0])
    sources, references = first_pairs(dataset, range(len(dataset)), checkpoint["model_config"].get("max_positions"))
    return timed_check(checkpoint, sources, references, resolve_device("auto"), name, search)


def check_averaged(output: str | Path, averaged: list[Path], search: SearchOptions | None = None) -> None:
    """`nmt average`'s check, after averaging: the checkpoint at ``output`` checked with ``search`` on
    the validation split that the run of its last input (``averaged``, oldest first) validated on,
    with the record written into it."""
    output = Path(output)
    checkpoint = load_checkpoint(output)
    train_config = load_checkpoint(averaged[-1], mmap=True, verify=("train_config",)).get("train_config")
    save_with_record(output, checkpoint, check_with_training_data(checkpoint, train_config, output.name, search))
