"""meta.json as DatasetMeta: what is written, what an older or hand-made record still opens as, and
the one-line error for one that is not a record."""

from __future__ import annotations

import json

import pytest

from nmt.data.meta import DatasetMeta, SplitMeta
from nmt.errors import NmtError

# A meta.json exactly as `nmt preprocess` wrote it before DatasetMeta (format 1).
WRITTEN_BEFORE = {
    "format": 1, "nmt_version": "0.1.0", "source_lang": "en", "target_lang": "de", "joint": True,
    "vocab_files": {"en": "spm.model", "de": "spm.model"}, "vocab_sizes": {"en": 100, "de": 100},
    "spm_sha256": {"en": "ab12", "de": "ab12"},
    "splits": {"train": {"sentences": 298, "input_lines": 300, "source_file": "/text/train.en",
                         "target_file": "/text/train.de", "dropped": {"empty": 2, "too_long": 0, "ratio": 0},
                         "source_tokens": 3100, "source_unk": 0, "target_tokens": 3200, "target_unk": 1},
               "valid": {"sentences": 40, "input_lines": 40, "source_file": "/text/valid.en",
                         "target_file": "/text/valid.de", "source_tokens": 400, "source_unk": 3,
                         "target_tokens": 420, "target_unk": 0}},
    "options": {"source_lang": "en", "vocab_size": 100}, "inputs": {"/text/train.en": {"size": 9, "mtime_ns": 1}},
}


def test_a_record_written_before_opens_typed_and_is_written_back_the_same(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps(WRITTEN_BEFORE), encoding="utf-8")
    meta = DatasetMeta.load(tmp_path)
    assert meta.joint and meta.splits["train"].dropped == {"empty": 2, "too_long": 0, "ratio": 0}
    assert meta.splits["valid"] == SplitMeta(40, 40, "/text/valid.en", "/text/valid.de", None, 400, 3, 420, 0)
    assert meta.inputs == WRITTEN_BEFORE["inputs"] and meta.options["vocab_size"] == 100
    (tmp_path / "copy").mkdir()
    meta.save(tmp_path / "copy")
    assert json.loads((tmp_path / "copy" / "meta.json").read_text(encoding="utf-8")) == WRITTEN_BEFORE


def test_a_minimal_record_opens_and_unknown_keys_are_ignored(tmp_path):
    record = {"source_lang": "en", "target_lang": "de", "vocab_files": {"en": "spm.en.model", "de": "spm.de.model"},
              "splits": {"test": {"sentences": 3, "added_later": 1}}, "added_later": {"x": 1}}
    (tmp_path / "meta.json").write_text(json.dumps(record), encoding="utf-8")
    meta = DatasetMeta.load(tmp_path)
    assert not meta.joint and meta.splits == {"test": SplitMeta(sentences=3)} and meta.vocab_sizes == {}


def test_non_ascii_stays_readable_json(tmp_path):
    DatasetMeta("en", "de", {"en": "spm.model", "de": "spm.model"},
                {"test": SplitMeta(sentences=1, source_file="/größe/test.en")}).save(tmp_path)
    assert "/größe/test.en" in (tmp_path / "meta.json").read_text(encoding="utf-8")
    assert DatasetMeta.load(tmp_path).splits["test"].source_file == "/größe/test.en"


@pytest.mark.parametrize("record", [
    {"source_lang": "en", "target_lang": "de", "splits": {}},  # no vocab_files
    {"source_lang": "en", "target_lang": "de", "splits": {}, "vocab_files": {"en": "spm.model"}},  # no de model
    {"source_lang": "en", "target_lang": "de", "splits": {"test": {"input_lines": 3}},
     "vocab_files": {"en": "spm.model", "de": "spm.model"}},  # a split without its size
    {"source_lang": "en", "target_lang": "de", "splits": {}, "samples": {"train.sample1": {}},
     "vocab_files": {"en": "spm.model", "de": "spm.model"}},  # a sampled segmentation without its size
    {"source_lang": "en", "target_lang": "de", "splits": {}, "samples": ["train.sample1"],
     "vocab_files": {"en": "spm.model", "de": "spm.model"}},
    {"source_lang": "en", "target_lang": "de", "splits": {}, "inputs": {"/data/train.en": 5},
     "vocab_files": {"en": "spm.model", "de": "spm.model"}},  # an input without its size and digest
    ["not", "a", "mapping"],
])
def test_a_record_missing_what_reading_needs_is_one_line(tmp_path, record):
    (tmp_path / "meta.json").write_text(json.dumps(record), encoding="utf-8")
    with pytest.raises(NmtError) as error:
        DatasetMeta.load(tmp_path)
    assert str(error.value) == (f"{tmp_path}/meta.json is not an `nmt preprocess` record (it needs source_lang, "
                                "target_lang, splits, vocab_files); run preprocess again")
