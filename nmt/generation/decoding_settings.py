"""A quantization and a stop rule: what a model's validation check recorded in its checkpoint
(nmt/training/decoding_check.py), and what ``--quantize auto`` and ``--stop auto`` decode with.

int8 dynamic quantization and ``--stop current`` or ``finished`` are faster and usually keep BLEU,
but not always (on the demo task finished search scored 93.3 against exact search's 99.2): they are
the defaults only for a model whose own validation set showed they keep its BLEU. A checkpoint
without a record decodes as before (fp32 or the chosen precision, exact search). ``auto`` is
resolved here, before any search: the search itself never sees it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from nmt.checkpoint.format import load_checkpoint
from nmt.checkpoint.names import split_paths
from nmt.device import resolve_device
from nmt.device_options import InferenceDeviceOptions
from nmt.errors import NmtError
from nmt.generation.options import SearchOptions

RECORD_KEY = "decoding"  # the checkpoint entry
STOP_RULES = ("exact", "current", "finished")  # the safest first (nmt/generation/search.py's is_done)
NO_RECORD = ("no validation check in {}: training's end records one, and `nmt average` of a run's checkpoints "
             "with its data directory here")


@dataclass(frozen=True)
class DecodingSettings:
    """A quantization and stop rule, and why: a setting the validation check tries, what it chose (a
    checkpoint's ``decoding`` record), or what a surface decodes with once ``auto`` is resolved."""

    quantize: str  # none or int8
    stop: str  # one of STOP_RULES
    reason: str = ""  # e.g. "validation check, 500 sentences: fp32 exact 38.95, int8 finished 38.81 BLEU: ..."
    # The check's search (CHECKED_SEARCH's values), whose stop rule alone the choice holds for; None:
    # generate's defaults, which a record written before it named its search was checked with.
    search: dict[str, Any] | None = None

    def name(self, precision: str = "fp32") -> str:
        """The setting alone: "int8 finished", "fp32 exact" (without int8: ``precision``, "bf16 exact")."""
        return f"{precision if self.quantize == 'none' else self.quantize} {self.stop}"

    def describe(self) -> str:
        """For the log line of each surface that decodes with it."""
        return f"quantize {self.quantize}, stop {self.stop} ({self.reason})"

    def checked_search(self) -> dict[str, Any]:
        """The search the check ran, by SearchOptions' names."""
        return self.search if self.search is not None else SearchOptions().checked()

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint's record: plain types, which a weights-only load reads."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Any, where: str = "the checkpoint") -> DecodingSettings:
        required = ("quantize", "stop", "reason")  # search: since records named it; one named by other
        # options than today's (another version's) is a different search: it never matches, so stop is exact
        if not isinstance(values, dict) or not set(required) <= set(values) \
                or values["quantize"] not in ("none", "int8") or not isinstance(values["stop"], str) \
                or not (values.get("search") is None or isinstance(values["search"], dict)):
            raise NmtError(f"{where} has a malformed {RECORD_KEY!r} record: {values!r}")
        if values["stop"] not in STOP_RULES:  # a later version's rule: this one searches exactly
            values = {**values, "stop": "exact", "reason": f"{values['reason']}; stop {values['stop']} is unknown here"}
        return cls(*(values[name] for name in required), values.get("search"))  # a later version's others are left


def describe_search(search: dict[str, Any]) -> str:
    """As generate's options: "--beam 4 --lenpen 0.6 ..."."""
    return " ".join(f"--{name.replace('_', '-')} {value}" for name, value in search.items())


def resolve_decoding(quantize: str, stop: str, precision: str, device_type: str,
                     records: dict[str, DecodingSettings | None]) -> DecodingSettings:
    """``auto`` as the checkpoints' records (by path) say: int8 only if every model's check chose it,
    on the CPU and without an explicit bf16/fp16 precision; the stop rule every check allows (the
    safest of their choices).
    Without a record: none and exact, today's behaviour. Explicit settings stay as given."""
    if "auto" not in (quantize, stop):
        return DecodingSettings(quantize, stop, "asked for")
    missing = [path for path, record in records.items() if record is None]
    if missing:
        where = "the checkpoint" if len(records) == 1 else ", ".join(missing)
        return DecodingSettings("none" if quantize == "auto" else quantize, "exact" if stop == "auto" else stop,
                                f"auto: {NO_RECORD.format(where)}")
    asked = [f"--{name} {value} asked for" for name, value in (("quantize", quantize), ("stop", stop))
             if value != "auto"]
    notes = []
    if quantize == "auto":
        quantize = "int8" if all(record.quantize == "int8" for record in records.values()) else "none"
        if quantize == "int8" and device_type != "cpu":
            quantize = "none"
            notes.append(f"int8 is for CPU decoding, not {device_type}")
        elif quantize == "int8" and precision not in ("auto", "fp32"):
            quantize = "none"
            asked.append(f"--precision {precision} asked for")
    searches = [record.checked_search() for record in records.values()]
    if stop == "auto":
        stop = min((record.stop for record in records.values()), key=STOP_RULES.index)
        if stop != "exact" and any(search != searches[0] for search in searches):
            stop = "exact"
            notes.append("stop exact: the models' checks ran different searches")
    checks = [record.reason if len(records) == 1 else f"{path}: {record.reason}" for path, record in records.items()]
    reason = "; ".join(asked + ["auto: " + "; ".join(notes + checks)])
    return DecodingSettings(quantize, stop, reason, next(iter(records.values())).search)


def read_records(path: str | list[str]) -> dict[str, DecodingSettings | None]:
    """Each checkpoint's record (``a.pt:b.pt`` or a list for an ensemble), its tensors left unread."""
    paths = [item for given in (path if isinstance(path, list) else [path]) for item in split_paths(str(given))]
    records = {}
    for item in paths:
        record = load_checkpoint(item, mmap=True, verify=(RECORD_KEY,)).get(RECORD_KEY)
        records[item] = None if record is None else DecodingSettings.from_dict(record, item)
    return records


def decoding_settings(compute: InferenceDeviceOptions, search: SearchOptions | None, path: str | list[str]
                      ) -> DecodingSettings:
    """What `nmt generate`, the API and the server decode with: ``--quantize`` and ``--stop``, their
    ``auto`` resolved from the checkpoints' records (each surface logs it where it logs the precision).
    ``search`` None (the API and the server, whose calls bring their own searches): the stop rule as
    the records give it, which each call's search then takes or not (stop_for)."""
    stop = "auto" if search is None else search.stop
    records = read_records(path) if "auto" in (compute.quantize, stop) else {}
    device_type = resolve_device(compute.device).type
    settings = resolve_decoding(compute.quantize, stop, compute.precision, device_type, records)
    return settings if search is None else for_search(settings, search)


def for_search(settings: DecodingSettings, search: SearchOptions) -> DecodingSettings:
    """``settings`` as ``search`` takes them: the record's stop rule where its check ran this search,
    else exact, with the reason naming the options in which the two differ."""
    stop = stop_for(search, settings)
    if stop == settings.stop:
        return settings
    checked, this = settings.checked_search(), search.checked()
    if checked.keys() != this.keys():  # another version's record: no search of this one matches it
        why = f"the check ran another version's search ({describe_search(checked)})"
    else:
        differ = ", ".join(f"--{name.replace('_', '-')} {this[name]} (the check's: {value})"
                           for name, value in checked.items() if this[name] != value)
        why = f"this search has {differ}; with the check's, stop {settings.stop}"
    return dataclasses.replace(settings, stop=stop, reason=f"{settings.reason}; stop exact: {why} (or have `nmt "
                               "average` check this search: --check-beam, --check-lenpen, ...)")


def stop_for(search: SearchOptions, settings: DecodingSettings | None) -> str:
    """The stop rule of a search whose ``stop`` may be auto: the record's (in ``settings``) where the
    search ends sentences as the check's did, else exact; without settings (a model decoded through
    the library, which knows no record) exact."""
    if search.stop != "auto":
        return search.stop
    if settings is None:
        return "exact"
    return settings.stop if search.checked() == settings.checked_search() else "exact"
