"""Which fast decoding settings keep a model's BLEU: a check on its validation set, recorded in the
checkpoint, and how ``--quantize auto`` and ``--stop auto`` read that record.

int8 dynamic quantization (1.35x bf16's speed and 1.9x fp32's on a Zen 4) and ``--stop finished``
(about 1.3x) usually keep BLEU, but not always: on the demo task finished search scored 93.3
against exact search's 99.2. So they are the defaults only for a model whose own validation set
showed they keep its BLEU. `nmt average` and the end of `nmt train` run the check and store its
choice under the checkpoint's ``decoding`` key (a plain dict); a checkpoint without one decodes
as before (fp32 or the chosen precision, exact search).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np
import torch
from torch import nn

from nmt.checkpoint.format import load_checkpoint, model_from_checkpoint, save_checkpoint
from nmt.checkpoint.names import split_paths
from nmt.data.dataset import DataDir, ParallelDataset
from nmt.data.vocabulary import Vocabularies
from nmt.device import resolve_device
from nmt.device_options import BLEU_TOLERANCE, InferenceDeviceOptions
from nmt.errors import NmtError
from nmt.generation.inference import inference_model, translate_ids
from nmt.generation.options import SearchOptions
from nmt.log import logger
from nmt.scoring import MetricOptions, score
from nmt.training.config import subset_names

RECORD_KEY = "decoding"  # the checkpoint entry
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


class Setting(NamedTuple):
    quantize: str  # none or int8
    stop: str  # exact or finished

    def describe(self) -> str:
        return f"{'fp32' if self.quantize == 'none' else self.quantize} {self.stop}"


REFERENCE = Setting("none", "exact")
CANDIDATES = (Setting("int8", "finished"), Setting("int8", "exact"), Setting("none", "finished"))  # fastest first


@dataclass(frozen=True)
class DecodingSettings:
    """A quantization and stop rule, and why: what a validation check chose (a checkpoint's
    ``decoding`` record), or what a surface decodes with once ``auto`` is resolved."""

    quantize: str  # none or int8
    stop: str  # exact or finished
    reason: str  # e.g. "validation check, 500 sentences: fp32 exact 38.95, int8 finished 38.81 BLEU: ..."

    def describe(self) -> str:
        """For the log line of each surface that decodes with it."""
        return f"quantize {self.quantize}, stop {self.stop} ({self.reason})"

    def to_dict(self) -> dict[str, str]:
        """The checkpoint's record: plain types, which a weights-only load reads."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Any, where: str = "the checkpoint") -> DecodingSettings:
        fields = [spec.name for spec in dataclasses.fields(cls)]
        if not isinstance(values, dict) or not set(fields) <= set(values) \
                or values["quantize"] not in ("none", "int8") or values["stop"] not in ("exact", "finished"):
            raise NmtError(f"{where} has a malformed {RECORD_KEY!r} record: {values!r}")
        return cls(**{name: values[name] for name in fields})  # a later version's other entries are left


def choose_decoding(reference: float, scored: Iterable[tuple[Setting, float]], sentences: int,
                    note: str = "") -> DecodingSettings:
    """The first of ``scored`` (fastest first, consumed only as far as needed) whose BLEU is within
    BLEU_TOLERANCE of the ``reference`` setting's; none of them: the reference setting."""
    seen = [f"{REFERENCE.describe()} {reference:.2f}"]
    for setting, bleu in scored:
        seen.append(f"{setting.describe()} {bleu:.2f}")
        if bleu >= reference - BLEU_TOLERANCE:
            return DecodingSettings(*setting, check_reason(sentences, seen, f"{setting.describe()} kept it", note))
    return DecodingSettings(*REFERENCE, check_reason(sentences, seen, "no faster setting kept it", note))


def check_reason(sentences: int, seen: list[str], verdict: str, note: str) -> str:
    return (f"validation check, {sentences} sentences: {', '.join(seen)} BLEU: {verdict} "
            f"(within {BLEU_TOLERANCE}){note}")


def check_decoding(checkpoint: dict[str, Any] | str | Path, sources: Sequence[np.ndarray],
                   references: Sequence[np.ndarray], device: torch.device) -> DecodingSettings:
    """Decode the first CHECK_SENTENCES sources (token ids ending in EOS) with the reference setting
    (fp32, exact search) and the faster candidates, fastest first, and choose by corpus BLEU against
    ``references`` (both sides detokenized by the target vocabulary). The search and the shortlist
    are `nmt generate`'s defaults on ``device`` (on a GPU: no shortlist); int8 is tried on the CPU only."""
    checkpoint = checkpoint if isinstance(checkpoint, dict) else load_checkpoint(checkpoint)
    sources, references = list(sources[:CHECK_SENTENCES]), list(references[:CHECK_SENTENCES])
    if not sources or len(sources) != len(references):
        raise NmtError(f"the decoding check needs sources and references, one for one; got {len(sources)} and "
                       f"{len(references)}")
    if len(sources) < MIN_CHECK_SENTENCES:
        raise TooFewSentences(f"{len(sources)} validation sentences, fewer than the {MIN_CHECK_SENTENCES} the check "
                              f"needs to tell {BLEU_TOLERANCE} BLEU from a word or two")
    vocabs = Vocabularies.from_state(checkpoint["vocab"])
    decoded_references = [vocabs.target.decode(reference) for reference in references]
    models: dict[str, nn.Module] = {}  # by quantize: fp32 serves the reference and fp32 finished

    def bleu(setting: Setting) -> float:
        if setting.quantize not in models:
            model = model_from_checkpoint(checkpoint)[0]  # afresh: int8 changes the model it quantizes
            models[setting.quantize] = inference_model(model, setting.quantize).to(device)
        found = translate_ids(models[setting.quantize], sources, SearchOptions(stop=setting.stop), device=device,
                              precision="fp32", shortlist=vocabs.shortlist)
        hypotheses = [vocabs.target.decode(hyps[0].tokens) for hyps in found]
        return score(hypotheses, [decoded_references], options=MetricOptions(language=vocabs.target_lang))[0].score

    candidates = [setting for setting in CANDIDATES if setting.quantize == "none" or device.type == "cpu"]
    note = "" if len(candidates) == len(CANDIDATES) else f"; int8 not tried on {device.type}"
    return choose_decoding(bleu(REFERENCE), ((setting, bleu(setting)) for setting in candidates), len(sources), note)


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
                device: torch.device, name: str) -> DecodingSettings | None:
    """``check_decoding``, with one log line of its choice and its cost; one saying why when it cannot
    run (too few sentences to decode, a BLEU tokenizer missing here), which leaves the model
    unchecked rather than failing the training or averaging that asked for it. A small validation
    split is a normal case, said at the info level; the others are warnings."""
    started = time.perf_counter()
    try:
        choice = check_decoding(checkpoint, sources, references, device)
    except TooFewSentences as exc:
        logger.info(SKIPPED, name, exc)
        return None
    except NmtError as exc:
        logger.warning(SKIPPED, name, exc)
        return None
    logger.info("decoding check of %s: quantize %s, stop %s, in %.1f s on %s (%s)", name, choice.quantize,
                choice.stop, time.perf_counter() - started, device, choice.reason)
    return choice


def check_with_training_data(checkpoint: dict[str, Any], train_config: dict[str, Any] | None,
                             name: str) -> DecodingSettings | None:
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
    return timed_check(checkpoint, sources, references, resolve_device("auto"), name)


# -- --quantize auto and --stop auto ----------------------------------------------------------------------

NO_RECORD = ("no validation check in {}: training's end records one, and `nmt average` of a run's checkpoints "
             "with its data directory here")


def resolve_decoding(quantize: str, stop: str, precision: str, device_type: str,
                     records: dict[str, DecodingSettings | None]) -> DecodingSettings:
    """``auto`` as the checkpoints' records (by path) say: int8 only if every model's check chose it,
    on the CPU and without an explicit bf16/fp16 precision; finished only if every check chose it.
    Without a record: none and exact, today's behaviour. Explicit settings stay as given."""
    if "auto" not in (quantize, stop):
        return DecodingSettings(quantize, stop, "asked for")
    missing = [path for path, record in records.items() if record is None]
    if missing:
        where = "the checkpoint" if len(records) == 1 else ", ".join(missing)
        return DecodingSettings("none" if quantize == "auto" else quantize, "exact" if stop == "auto" else stop,
                                f"auto: {NO_RECORD.format(where)}")
    notes = [f"--{name} {value} asked for" for name, value in (("quantize", quantize), ("stop", stop))
             if value != "auto"]
    if quantize == "auto":
        quantize = "int8" if all(record.quantize == "int8" for record in records.values()) else "none"
        if quantize == "int8" and device_type != "cpu":
            quantize = "none"
            notes.append(f"int8 is for CPU decoding, not {device_type}")
        elif quantize == "int8" and precision not in ("auto", "fp32"):
            quantize = "none"
            notes.append(f"--precision {precision} asked for")
    if stop == "auto":
        stop = "finished" if all(record.stop == "finished" for record in records.values()) else "exact"
    checks = [record.reason if len(records) == 1 else f"{path}: {record.reason}" for path, record in records.items()]
    return DecodingSettings(quantize, stop, "auto: " + "; ".join(notes + checks))


def read_records(path: str | list[str]) -> dict[str, DecodingSettings | None]:
    """Each checkpoint's record (``a.pt:b.pt`` or a list for an ensemble), its tensors left unread."""
    paths = [item for given in (path if isinstance(path, list) else [path]) for item in split_paths(str(given))]
    records = {}
    for item in paths:
        record = load_checkpoint(item, mmap=True, verify=(RECORD_KEY,)).get(RECORD_KEY)
        records[item] = None if record is None else DecodingSettings.from_dict(record, item)
    return records


def decoding_settings(compute: InferenceDeviceOptions, search: SearchOptions, path: str | list[str]
                      ) -> DecodingSettings:
    """What `nmt generate`, the API and the server decode with: ``--quantize`` and ``--stop``, their
    ``auto`` resolved from the checkpoints' records (each surface logs it where it logs the precision)."""
    records = read_records(path) if "auto" in (compute.quantize, search.stop) else {}
    device_type = resolve_device(compute.device).type
    settings = resolve_decoding(compute.quantize, search.stop, compute.precision, device_type, records)
    stop = stop_for(search, settings)
    if stop == settings.stop:
        return settings
    return dataclasses.replace(settings, stop=stop, reason=f"{settings.reason}; stop exact: the check searched with "
                               "generate's beam, length penalty and length limits, not these")


# What decides whether finished search keeps exact search's translations; the check searched with
# generate's defaults, so its verdict on the stop rule holds for those only.
CHECKED_SEARCH = ("beam", "lenpen", "lenpen_style", "max_len_a", "max_len_b", "min_len")


def stop_for(search: SearchOptions, settings: DecodingSettings) -> str:
    """The stop rule of a search whose ``stop`` may be auto: the record's (in ``settings``) where the
    search ends sentences as the check's did, else exact."""
    if search.stop != "auto":
        return search.stop
    defaults = SearchOptions()
    same = all(getattr(search, name) == getattr(defaults, name) for name in CHECKED_SEARCH)
    return settings.stop if same else "exact"
