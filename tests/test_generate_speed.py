"""benchmarks/generate_speed.py: what it sweeps and how it runs CTranslate2 alone (no timing here: the benchmark
prints its tables)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import needs_ct2, numbers_pairs, train_tiny_checkpoint

from nmt.data.vocabulary import EOS_ID
from nmt.export.ctranslate2 import export_ctranslate2
from nmt.export.options import ExportOptions
from nmt.generation.options import GenerateOptions
from nmt.generation.search import max_lengths
from nmt.options import build

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "generate_speed.py"


def benchmark():
    """The script as a module (registered first: its dataclasses look their module up)."""
    if "generate_speed" not in sys.modules:
        spec = importlib.util.spec_from_file_location("generate_speed", SCRIPT)
        sys.modules["generate_speed"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["generate_speed"])
    return sys.modules["generate_speed"]


def test_every_split_of_the_threads_is_swept_on_a_cpu_and_one_translator_on_a_gpu():
    speed = benchmark()
    assert speed.thread_splits(1, "cpu") == [(1, 1)]
    assert speed.thread_splits(2, "cpu") == [(1, 2), (2, 1)]
    assert speed.thread_splits(4, "cpu") == [(1, 4), (2, 2), (4, 1)]
    assert speed.thread_splits(4, "cuda") == [(1, 4)]


def test_batches_are_tokens_or_examples():
    speed = benchmark()
    assert speed.parse_batches("tokens:256,examples:32") == [("tokens", 256), ("examples", 32)]
    for wrong in ("tokens", "sentences:8", "tokens:0", "tokens:-1"):
        with pytest.raises(SystemExit, match="is not tokens:SIZE or examples:SIZE"):
            speed.parse_batches(wrong)


def test_a_round_alternates_the_engines_per_thread_count():
    speed = benchmark()
    ours = [speed.Job(name, threads, {}) for threads in (1, 2) for name in ("shipped", "ct2-int8")]
    theirs = [speed.Job(f"ct2 {i}", threads, {}) for threads in (1, 2) for i in range(3)]
    assert [(job.label, job.threads) for job in speed.interleave(ours, theirs)] == [
        ("shipped", 1), ("ct2 0", 1), ("ct2-int8", 1), ("ct2 1", 1), ("ct2 2", 1),
        ("shipped", 2), ("ct2 0", 2), ("ct2-int8", 2), ("ct2 1", 2), ("ct2 2", 2)]


@pytest.fixture(scope="module")
def exported(tiny_data_dir, tmp_path_factory):
    trained = train_tiny_checkpoint(tiny_data_dir, tmp_path_factory.mktemp("speed-train"))
    return export_ctranslate2(ExportOptions(str(trained), str(tmp_path_factory.mktemp("speed-ct2") / "model")))


@needs_ct2
@pytest.mark.parametrize("limits", ["sentence", "one"])
def test_ctranslate2_alone_runs_without_torch_and_decodes_as_the_engine(exported, limits):
    """The sweep's process imports neither torch nor nmt; with the max length per sentence (one call per
    length, CTranslate2 cutting the batches) its translations are `--engine ctranslate2`'s (float32, alpha 0)."""
    from nmt.export.ctranslate2 import load_vocabularies
    from nmt.generation.ctranslate2_engine import open_translator, translate_ids_ctranslate2

    vocabs = load_vocabularies(exported)
    lines = [s for s, _ in numbers_pairs(40, 11)] + [""]
    ids = [np.asarray(s + [EOS_ID]) for s in vocabs.source.encode_batch(lines)]
    limits_of = max_lengths(torch.tensor([len(s) - 1 for s in ids]), 1.0, 50).tolist()
    peer = dict(threads=2, inter=2, intra=1, compute_type="float32", batch_type="tokens", max_batch_size=64,
                limits=limits, vmap=False)
    job = dict(engine="ctranslate2", peer=peer, model=str(exported), device="cpu", device_index=0, limits=limits_of,
               beam=4, lenpen=0.0, pieces=[[vocabs.source.piece(int(i)) for i in s[:-1]] for s in ids])
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import generate_speed; "
            "run = generate_speed.peer_run(json.loads(sys.stdin.read())); "
            "print(json.dumps([run.outputs, sorted({'torch', 'nmt'} & set(sys.modules))]))")
    done = subprocess.run([sys.executable, "-c", code, str(SCRIPT.parent)], input=json.dumps(job), text=True,
                          capture_output=True, check=True)
    outputs, imported = json.loads(done.stdout)
    assert imported == [] and outputs[-1] == []  # the empty line: EOS alone
    options = build(GenerateOptions, {"input": "-", "beam": 4, "lenpen": 0.0, "max_len_b": 50})
    translator, vocabs, max_positions = open_translator(exported, torch.device("cpu"), "default", 2)
    engine = translate_ids_ctranslate2(translator, vocabs, ids, options, max_positions=max_positions)
    assert [[vocabs.target.processor.piece_to_id(p) for p in hyp] + [EOS_ID] for hyp in outputs] == \
        [hyps[0].tokens for hyps in engine]
