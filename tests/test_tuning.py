"""Process-wide tuning for decoding (nmt/tuning.py): set by `nmt generate` and `nmt serve` only, and by a
program that asks (the API leaving the process alone is tested in test_generate.py)."""

from __future__ import annotations

import os
import sys

import pytest

import nmt.__main__
from nmt import tuning


def test_tuning_bounds_onednn_caches_unless_the_user_sized_them(monkeypatch):
    """The caches behind bf16 products keep an entry per product shape; decoding's shapes change at every step."""
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setattr(tuning, "share_one_malloc_arena", lambda: None)  # this process's allocator stays as it is
    tuning.tune_for_decoding()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == os.environ["LRU_CACHE_CAPACITY"] == \
        str(tuning.ONEDNN_CACHE_CAPACITY)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")
    tuning.tune_for_decoding()
    assert os.environ["LRU_CACHE_CAPACITY"] == "512"


@pytest.mark.parametrize("subcommand, huge_pages, tuned, bounded", [
    ("generate", True, True, False), ("serve", False, True, False), ("train", False, False, True),
    ("run", False, False, True), ("average", False, False, False), ("--version", False, False, False)])
def test_only_the_decoding_subcommands_tune_the_process(monkeypatch, subcommand, huge_pages, tuned, bounded):
    """Huge pages (where asked for) for generate only; the allocator settings wherever nmt decodes;
    small oneDNN caches for training too (bf16 products at a new shape every batch)."""
    calls = []
    monkeypatch.setattr(sys, "argv", ["/venv/bin/nmt", subcommand, "--help"])
    monkeypatch.setattr(nmt.__main__, "restart_with_huge_pages", lambda: calls.append("huge pages"))
    monkeypatch.setattr(nmt.__main__, "tune_for_decoding", lambda: calls.append("tuned"))
    monkeypatch.setattr(nmt.__main__, "bound_onednn_caches", lambda: calls.append("bounded"))
    with pytest.raises(SystemExit):
        nmt.__main__.main()
    assert calls == ["huge pages"] * huge_pages + ["tuned"] * tuned + ["bounded"] * bounded
