"""The server's batch memory estimate (nmt/serving/budget.py) against what a batch takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nmt.backends.kernel_build import built_kernels

# In a process of its own: load, decode one sentence (torch's own buffers), then the heaviest batch
# that the estimate admits within the budget, every beam running to the length limit; the peak
# resident memory it added (VmHWM, reset to the current RSS first) against the estimate.
HEAVIEST_BATCH = """
import json, sys
from pathlib import Path
import numpy, torch
from nmt.generation.inference import TranslationRequest, prepare_model, translate_ids
from nmt.generation.options import BatchingOptions, SearchOptions
from nmt.serving.batcher import Tally
from nmt.serving.budget import SearchMemory

def status(field):
    return next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith(field + ":"))

path, budget, backend = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model, _ = prepare_model(path, torch.device("cpu"), backend=backend)
beam, limit, source = 4, 120, numpy.array([5, 6, 7, 8, 3])
memory, sentences = SearchMemory(model, "fp32", "cpu"), 0
tally = Tally(memory, beam)
while tally.with_sentence(len(source), limit) <= budget:
    tally.add(len(source), limit)
    sentences += 1
request = TranslationRequest(SearchOptions(beam=beam, max_len_a=0, max_len_b=limit, min_len=limit, stop="exact"),
                             BatchingOptions(max_tokens=None, batch_size=sentences, workers=1))
translate_ids(model, [source], request)
before = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")
translate_ids(model, [source] * sentences, request)
print(json.dumps({"sentences": sentences, "estimate": memory.batch([limit] * sentences, beam, len(source)),
                  "peak": status("VmHWM") - before, "terms": memory.row_terms(limit)}))
"""
BUDGET = 64 * 2 ** 20


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures Linux's peak resident memory")
@pytest.mark.parametrize("backend", ["torch", pytest.param("auto", marks=pytest.mark.skipif(
    built_kernels()[0] is None, reason="nmt's CPU kernels could not be built here"))])
def test_the_heaviest_batch_the_estimate_admits_takes_no_more_than_estimated(untrained_checkpoint, backend):
    """What the cache and the search report they allocate, summed: an upper bound of the memory the
    batch took (measured: 94% of it, with either backend), allowing 10% for the allocator's slack and
    pages, which it does not count; and not so loose that it wastes the budget (at most 1.5 times)."""
    env = {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"}  # 4 KiB pages
    done = subprocess.run([sys.executable, "-c", HEAVIEST_BATCH, str(untrained_checkpoint), str(BUDGET), backend],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["sentences"] > 20 and measured["estimate"] <= BUDGET  # a batch, within the budget
    assert measured["peak"] <= 1.1 * measured["estimate"] <= 1.65 * measured["peak"], measured
