"""nmt generate end to end: inputs, outputs, order, batching invariance, formats, quantization, errors."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, make_data_dir, numbers_pairs, run_cli, run_nmt

import nmt.generation.inference as inference_module
from nmt.backends.int8 import Int8Linear
from nmt.checkpoint.format import Vocabularies, model_state, save_checkpoint
from nmt.data.dataset import DataDir
from nmt.data.vocabulary import EOS_ID, PAD_ID
from nmt.device import inference_device
from nmt.device_options import InferenceDeviceOptions
from nmt.errors import NmtError
from nmt.generation.generate import generate
from nmt.generation.inference import TranslationRequest, prepare_model, translate_ids
from nmt.generation.options import BatchingOptions, GenerateOptions, SearchOptions, check_workers, choose_workers
from nmt.generation.translator import Translator
from nmt.generation.workers import KeptWorkers, forks_workers, map_in_workers
from nmt.log import logger
from nmt.models.registry import build_model, get_arch, resolve_config
from nmt.models.transformer import FeedForward
from nmt.options import build
from nmt.scoring import MetricOptions, score

LINES = ["five", "Turn to page twelve.", "the number four", "My room number is eighty-two.", "seven",
         "I counted to nine thousand and one yesterday.", "She said three twice.", "the number sixty"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Train/test splits of the numbers task; meta.json names the raw test reference like preprocess does."""
    root = tmp_path_factory.mktemp("generate-data")
    pairs = numbers_pairs(330, seed=1)
    directory = make_data_dir(root / "bin", {"train": pairs[:300], "test": pairs[300:]})
    raw = root / "test.de"
    raw.write_text("".join(target + "\n" for _, target in pairs[300:]), encoding="utf-8")
    datadir = DataDir.open(directory)
    datadir.meta.splits["test"].target_file = str(raw)
    datadir.meta.save(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoint(data_dir, tmp_path_factory):
    """An untrained but deterministic tiny model over the data dir's vocabulary."""
    vocab = DataDir.open(data_dir).vocabulary("en")
    torch.manual_seed(0)
    arch = get_arch("transformer_tiny")
    config = resolve_config(arch.config, {"d_model": 32, "ffn_dim": 64})
    model = build_model(arch.model_name, config, len(vocab), len(vocab), PAD_ID)
    with torch.no_grad():
        model.tgt_embed.weight.mul_(4.0)  # peaky distributions: no near-ties between hypotheses
    path = tmp_path_factory.mktemp("ckpt") / "model.pt"
    save_checkpoint(path, model_state(model, "transformer_tiny", config, Vocabularies("en", "de", vocab, vocab)))
    return path


def options(checkpoint, **kwargs) -> GenerateOptions:
    """GenerateOptions from flat option names, as the CLI and recipes give them (raw input by default)."""
    defaults = {"path": str(checkpoint), "max_len_b": 8, **({} if "data" in kwargs else {"input": "-"})}
    return build(GenerateOptions, {**defaults, **kwargs})


def best_tokens(result) -> list[list[int]]:
    return [t.hypotheses[0].tokens for t in result.translations]


def write(path, lines: list[str]):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_split_translations_keep_input_order(data_dir, checkpoint, tmp_path):
    out = tmp_path / "hyp.txt"
    result = generate(options(checkpoint, data=str(data_dir), output=str(out)))
    assert [t.index for t in result.translations] == list(range(30))
    vocab = DataDir.open(data_dir).vocabulary("de")
    assert out.read_text(encoding="utf-8").splitlines() == [vocab.decode(t) for t in best_tokens(result)]
    split = DataDir.open(data_dir).split("test")
    assert [t.source for t in result.translations] == [vocab.decode(split.source[i]) for i in range(30)]


@pytest.mark.slow
def test_hypotheses_do_not_depend_on_batching_or_input_order(data_dir, checkpoint):
    model, _ = prepare_model(checkpoint, torch.device("cpu"))
    split = DataDir.open(data_dir).split("test")
    sources = [split.source[i] for i in range(len(split))]
    assert len({len(s) for s in sources}) > 5  # lengths vary: batches hold padding
    search = dict(beam=3, nbest=3, max_len_b=6)

    def run(order: np.ndarray, **batching) -> list[list[list[int]]]:
        chosen = options(checkpoint, **search, **batching)
        hyps = translate_ids(model, [sources[i] for i in order], TranslationRequest(chosen.search, chosen.batching))
        restored = [None] * len(sources)
        for position, index in enumerate(order):
            restored[index] = [h.tokens for h in hyps[position]]
        return restored

    identity = np.arange(len(sources))
    shuffled = np.random.default_rng(0).permutation(len(sources))
    alone = run(identity, batch_size=1, max_tokens=None)
    assert run(identity, batch_size=64, max_tokens=None) == alone
    assert run(identity, batch_size=3, max_tokens=None) == alone
    assert run(identity, max_tokens=100) == alone
    assert run(shuffled, batch_size=7, max_tokens=None) == alone  # other neighbours, other padding
    assert run(identity[::-1], batch_size=64, max_tokens=None) == alone
    assert run(shuffled, batch_size=5, max_tokens=None, workers=3) == alone  # batches on three threads at once


def test_workers_run_batches_at_the_same_time_with_their_share_of_the_threads(checkpoint, data_dir, monkeypatch):
    model, _ = prepare_model(checkpoint, torch.device("cpu"))
    split = DataDir.open(data_dir).split("test")
    sources = [split.source[i] for i in range(len(split))]
    seen, lock, both_running = [], threading.Lock(), threading.Barrier(2, timeout=30)
    search = inference_module.beam_search

    def watched(*args, **kwargs):
        with lock:
            seen.append((threading.get_ident(), torch.is_inference_mode_enabled()))
            first_two = len(seen) <= 2
        if first_two:
            both_running.wait()  # the first two batches are in flight together, or this times out
        return search(*args, **kwargs)

    set_threads = []
    monkeypatch.setattr(inference_module, "beam_search", watched)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # as if the process had 4 threads: 2 per worker
    monkeypatch.setattr(torch, "set_num_threads", set_threads.append)
    chosen = options(checkpoint, beam=2, max_len_b=4, batch_size=4, max_tokens=None, workers=2)
    translate_ids(model, sources, TranslationRequest(chosen.search, chosen.batching))
    assert len(seen) >= 3 and set_threads == [2, 2, 4]  # once per worker, then the caller's count set back
    assert len({thread for thread, _ in seen}) == 2 and threading.get_ident() not in {t for t, _ in seen}
    assert all(inference for _, inference in seen)  # inference mode is per thread: each worker enters it


def test_cpu_decoding_runs_one_worker_per_thread_by_default_sharing_the_token_budget(checkpoint, data_dir,
                                                                                       monkeypatch, caplog):
    """Two threads: two workers, each a process of its own on Linux (one thread each), each batch
    with half the token budget; -v says so."""
    monkeypatch.setattr(logger, "propagate", True)  # the CLI's logging set-up turns it off; caplog listens at root
    caplog.set_level(logging.DEBUG, logger="nmt")
    model, _ = prepare_model(checkpoint, torch.device("cpu"))
    split = DataDir.open(data_dir).split("test")
    sources = [split.source[i] for i in range(len(split))]
    search = inference_module.beam_search
    seen = multiprocessing.get_context("fork").SimpleQueue()  # (worker, source tokens with padding) per batch

    def watched(model, source, *args, **kwargs):
        seen.put(((os.getpid(), threading.get_ident()), source.numel()))
        return search(model, source, *args, **kwargs)

    monkeypatch.setattr(inference_module, "beam_search", watched)
    # Two threads, one per worker. torch.set_num_threads stays real: a forked worker must set its one
    # thread, or its products wait forever on the parent's OpenMP threads, which a fork does not copy.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    longest = max(len(s) for s in sources)
    for workers, threads in ((None, 2), (1, 1)):
        chosen = options(checkpoint, beam=2, max_len_b=4, max_tokens=8 * longest, workers=workers)
        # fork_workers: as `nmt generate` asks
        translate_ids(model, sources, TranslationRequest(chosen.search, chosen.batching, fork_workers=True))
        batches = []
        while not seen.empty():
            batches.append(seen.get())
        assert len({worker for worker, _ in batches}) == threads
        forked = sys.platform == "linux" and threads == 2
        assert all((pid != os.getpid()) == forked for (pid, _), _ in batches)
        share = 8 * longest // (2 * threads)  # --max-tokens counts source tokens x beam, shared by the workers
        assert max(tokens for _, tokens in batches) <= share < 2 * max(tokens for _, tokens in batches)
        said = [record.getMessage() for record in caplog.records if record.getMessage().startswith("decoding workers")]
        assert said[-1] == ("decoding workers: one, 2 intra-op thread(s)" if threads == 1 else
                            f"decoding workers: 2 {'forked processes' if forked else 'threads of this process'}, "
                            "1 intra-op thread(s) each")


def test_several_workers_take_the_longest_batches_first(checkpoint, monkeypatch):
    """The batches that start last are then short ones, and the workers finish at about the same time."""
    model, _ = prepare_model(checkpoint, torch.device("cpu"))
    sources = [np.asarray([5] * (n % 7) + [EOS_ID]) for n in range(40)]
    given: dict[int, list[int]] = {}

    def record(function, batches, workers, processes=False):
        given[workers] = [max(len(source) for source in batch.sources) for batch in batches]
        return (function(batch) for batch in batches)

    monkeypatch.setattr(inference_module, "map_in_workers", record)
    for workers in (1, 2):
        chosen = options(checkpoint, beam=2, max_len_b=3, max_tokens=24, workers=workers)
        translate_ids(model, sources, TranslationRequest(chosen.search, chosen.batching))
    assert len(given[2]) > 2 and given[2] == sorted(given[2], reverse=True) and given[1] == sorted(given[1])


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked processes on Linux only")
def test_forked_workers_translate_as_one_worker_and_report_errors(checkpoint, data_dir, monkeypatch):
    model, _ = prepare_model(checkpoint, torch.device("cpu"))
    split = DataDir.open(data_dir).split("test")
    sources = [split.source[i] for i in range(len(split))]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # one thread per worker: forked
    assert forks_workers(2) and not forks_workers(1)

    def tokens(**batching) -> list[list[list[int]]]:
        chosen = options(checkpoint, beam=3, max_len_b=6, stop="exact", quantize="none", **batching)
        found = translate_ids(model, sources, TranslationRequest(chosen.search, chosen.batching, fork_workers=True))
        return [[h.tokens for h in hyps] for hyps in found]

    assert tokens(batch_size=3, max_tokens=None, workers=2) == tokens(batch_size=3, max_tokens=None, workers=1)

    def fail(item: int) -> int:
        if item == 2:
            raise NmtError("bad batch")
        return os.getpid()

    with pytest.raises(NmtError, match="bad batch"):
        list(map_in_workers(fail, range(4), workers=2, processes=True))
    assert os.getpid() not in map_in_workers(fail, [0, 1, 3], workers=2, processes=True)


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked processes on Linux only")
def test_kept_workers_serve_later_calls_and_are_forked_again_when_they_must_be(checkpoint, data_dir, monkeypatch):
    """A caller's KeptWorkers (a Translator's, generate's): the same processes decode its next calls, with
    the same output as one worker, even where it may not fork now; others for another model or more
    workers; new ones where one died between calls."""
    model, _ = prepare_model(checkpoint, torch.device("cpu"))
    other, _ = prepare_model(checkpoint, torch.device("cpu"))
    split = DataDir.open(data_dir).split("test")
    sources = [split.source[i] for i in range(len(split))]
    search = inference_module.beam_search
    seen = multiprocessing.get_context("fork").SimpleQueue()  # the process of each batch

    def watched(model, source, *args, **kwargs):
        seen.put(os.getpid())
        return search(model, source, *args, **kwargs)

    def decoded_in() -> set[int]:
        pids = set()
        while not seen.empty():
            pids.add(seen.get())
        return pids

    monkeypatch.setattr(inference_module, "beam_search", watched)
    threads = {"count": 2}
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads["count"])
    kept = KeptWorkers()

    def tokens(model, kept_workers=kept, may_fork=True, **batching) -> list[list[int]]:
        chosen = options(checkpoint, beam=3, max_len_b=6, stop="exact", quantize="none", batch_size=3,
                         max_tokens=None, **batching)
        found = translate_ids(model, sources, TranslationRequest(chosen.search, chosen.batching, fork_workers=may_fork,
                                                                 kept_workers=kept_workers))
        return [hyps[0].tokens for hyps in found]

    def workers() -> set[int]:
        return set(kept.forked.pool._processes)

    try:
        alone = tokens(model, kept_workers=None, workers=1)
        assert decoded_in() == {os.getpid()}
        assert tokens(model) == alone
        first = workers()
        assert len(first) == 2 and os.getpid() not in first and decoded_in() <= first
        assert tokens(model, may_fork=False) == alone and workers() == first and decoded_in() <= first
        assert tokens(other) == alone and decoded_in() <= workers() and workers().isdisjoint(first)
        second = workers()
        with kept.lock:  # another thread's call holds them: this one decodes on threads, here
            assert tokens(other, may_fork=False) == alone and decoded_in() == {os.getpid()}
        threads["count"] = 3
        assert tokens(other, may_fork=False) == alone and decoded_in() == {os.getpid()}  # threads: no fork allowed
        assert tokens(other) == alone and len(third := workers()) == 3 and third.isdisjoint(second)
        decoded_in()
        os.kill(next(iter(third)), signal.SIGKILL)  # between calls (Ctrl-C at a prompt reaches the workers too)
        deadline = time.monotonic() + 10
        while kept.forked.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tokens(other) == alone and workers().isdisjoint(third) and decoded_in() <= workers()
    finally:
        kept.close()
    assert kept.forked is None


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked processes on Linux only")
def test_a_translator_keeps_its_workers_until_it_is_closed(checkpoint, monkeypatch):
    search = inference_module.beam_search
    seen = multiprocessing.get_context("fork").SimpleQueue()  # the process of each batch

    def watched(model, source, *args, **kwargs):
        seen.put(os.getpid())
        return search(model, source, *args, **kwargs)

    monkeypatch.setattr(inference_module, "beam_search", watched)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with monkeypatch.context() as alone:
        alone.setattr(threading, "active_count", lambda: 1)  # pytest's own threads aside
        translator = Translator.from_checkpoint(checkpoint, quantize="none")
        first = translator.translate(["1 2 3", "4 5", "6"])
    workers = list(translator.kept_workers.forked.pool._processes.values())
    assert len(workers) == 2 and all(worker.is_alive() for worker in workers)
    assert threading.active_count() > 1  # the pool's own threads: the next call may not fork, and need not
    while not seen.empty():
        seen.get()
    assert translator.translate(["1 2 3", "4 5", "6"]) == first
    assert list(translator.kept_workers.forked.pool._processes.values()) == workers
    decoded_in = set()
    while not seen.empty():
        decoded_in.add(seen.get())
    assert decoded_in and decoded_in <= {worker.pid for worker in workers}
    with translator:
        pass
    assert not any(worker.is_alive() for worker in workers) and translator.kept_workers.forked is None


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked processes on Linux only")
def test_a_worker_that_dies_is_a_one_line_error_not_a_hang():
    def die(item: int) -> int:
        if item == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer would
        return item

    with pytest.raises(NmtError, match="a decoding worker process ended unexpectedly"):
        list(map_in_workers(die, range(4), workers=2, processes=True))


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked processes on Linux only")
def test_forked_workers_end_with_their_parent_however_it_ends(tmp_path):
    """A plain `kill` of `nmt generate` reaches the parent alone; its workers must not run on."""
    script = f"""
import os, time
from nmt.generation.workers import map_in_workers
def work(item):
    open({str(tmp_path)!r} + f"/worker-{{os.getpid()}}", "w").close()
    time.sleep(600)
list(map_in_workers(work, range(2), workers=2, processes=True))
"""
    parent = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("worker-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = [int(path.name.split("-")[1]) for path in tmp_path.glob("worker-*")]
    assert len(workers) == 2
    parent.kill()  # SIGKILL: the parent can do nothing about its workers
    parent.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    orphans = [pid for pid in workers if alive(pid)]
    for pid in orphans:
        os.kill(pid, signal.SIGKILL)
    assert not orphans


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended and not yet reaped by init, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_are_threads_unless_the_caller_may_fork_with_one_thread_each(checkpoint, data_dir, monkeypatch):
    """GNU OpenMP cannot start threads in a forked child; a library caller's program may hold locks
    in other threads; the server stops batches from its own thread."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert not forks_workers(2)  # two intra-op threads each
    model, _ = prepare_model(checkpoint, torch.device("cpu"))
    split = DataDir.open(data_dir).split("test")
    sources = [split.source[i] for i in range(len(split))]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)
    search = inference_module.beam_search
    processes = multiprocessing.get_context("fork").SimpleQueue()

    def watched(*args, **kwargs):
        processes.put(os.getpid())
        return search(*args, **kwargs)

    monkeypatch.setattr(inference_module, "beam_search", watched)
    chosen = options(checkpoint, beam=2, max_len_b=4, batch_size=4, max_tokens=None, workers=2)
    translate_ids(model, sources, TranslationRequest(chosen.search, chosen.batching))  # a library call: threads
    translate_ids(model, sources, TranslationRequest(chosen.search, chosen.batching, fork_workers=True,
                                                     should_stop=lambda: False))
    seen = set()
    while not processes.empty():
        seen.add(processes.get())
    assert seen == {os.getpid()}


def test_default_workers_follow_the_threads_and_the_input_but_never_sample_or_use_a_gpu(checkpoint):
    chosen = options(checkpoint)
    assert chosen.batching.workers is None
    assert choose_workers(chosen.search, chosen.batching, "cpu", threads=4, sentences=100) == 4
    assert choose_workers(chosen.search, chosen.batching, "cpu", threads=4, sentences=3) == 3
    assert choose_workers(chosen.search, chosen.batching, "cpu", threads=1, sentences=100) == 1
    assert choose_workers(chosen.search, chosen.batching, "cuda", threads=4, sentences=100) == 1
    sampling = options(checkpoint, sampling=True)
    assert choose_workers(sampling.search, sampling.batching, "cpu", threads=4, sentences=100) == 1
    given = options(checkpoint, workers=3)
    assert choose_workers(given.search, given.batching, "cpu", threads=8, sentences=100) == 3


def test_workers_refuse_sampling_and_gpus(checkpoint):
    with pytest.raises(NmtError, match="--workers > 1 cannot be used with --sampling"):
        options(checkpoint, sampling=True, workers=2)
    chosen = options(checkpoint, workers=2)
    with pytest.raises(NmtError, match="--workers > 1 is for CPU decoding"):
        check_workers(chosen.search, chosen.batching, torch.device("cuda"))


def has_glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "malloc_stats")
    except (OSError, TypeError):
        return False


DECODE_IN_THREADS = """
import ctypes, os, sys, numpy, torch
import nmt
from nmt.generation.inference import TranslationRequest, translate_ids
from nmt.generation.options import BatchingOptions
before = dict(os.environ)
if sys.argv[2] == "tuned":
    nmt.tune_for_decoding()
torch.set_num_threads(2)
translator = nmt.Translator.from_checkpoint(sys.argv[1], device="cpu")
translator.translate(["five", "seven"], stop="exact")
sources = [numpy.array([5 + i % 7, 6, 2]) for i in range(40)]
translate_ids(translator.model, sources, TranslationRequest(batching=BatchingOptions(max_tokens=40, workers=2)))
print(sorted(set(os.environ.items()) ^ set(before.items())))
ctypes.CDLL(None).malloc_stats()
"""


@pytest.mark.skipif(not has_glibc(), reason="glibc's malloc arenas")
@pytest.mark.parametrize("tuned", [False, True])
def test_the_api_leaves_the_allocator_and_environment_alone_unless_asked(checkpoint, tuned):
    """Loading and translating through the Python API changes neither the process's environment nor
    its allocator: its threads get their own malloc arenas, as glibc gives them. ``nmt.tune_for_decoding``
    (what `nmt generate` and `nmt serve` do) makes them share the main one and bounds oneDNN's caches."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("MALLOC_ARENA_MAX", "LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    done = subprocess.run([sys.executable, "-c", DECODE_IN_THREADS, str(checkpoint), "tuned" if tuned else "plain"],
                          capture_output=True, text=True, env=env, check=True)
    changed = "[('LRU_CACHE_CAPACITY', '16'), ('ONEDNN_PRIMITIVE_CACHE_CAPACITY', '16')]" if tuned else "[]"
    assert done.stdout.strip() == changed, done.stderr
    arenas = done.stderr.count("Arena ")
    assert arenas == 1 if tuned else arenas > 1, done.stderr


def test_workers_leave_the_callers_thread_count_as_it_was():
    """torch keeps a worker's (smaller) thread count for threads started later: it is set back."""
    before = torch.get_num_threads()
    seen = list(map_in_workers(lambda _: torch.get_num_threads(), range(4), workers=2))
    assert seen == [max(1, before // 2)] * 4
    later = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert torch.get_num_threads() == before and later == [before]


def test_an_error_in_a_worker_reaches_the_caller():
    def fail(item: int) -> int:
        if item == 2:
            raise NmtError("bad batch")
        return item

    with pytest.raises(NmtError, match="bad batch"):
        list(map_in_workers(fail, range(4), workers=2))


def test_raw_input_translations_match_one_sentence_runs(checkpoint, tmp_path):
    together = generate(options(checkpoint, input=write(tmp_path / "in.en", LINES)))
    assert [t.source for t in together.translations] == LINES
    for line, translation in zip(LINES[:3], together.translations):
        single = generate(options(checkpoint, input=write(tmp_path / "one.en", [line])))
        assert best_tokens(single) == [translation.hypotheses[0].tokens]


def test_empty_lines_become_empty_translations(checkpoint, tmp_path, capsys):
    source = write(tmp_path / "in.en", ["five", "", "   ", "the number four"])
    result = generate(options(checkpoint, input=source, nbest=2, beam=2))
    lines = capsys.readouterr().out.split("\n")[:-1]
    assert len(lines) == 8
    assert lines[2:6] == ["", "", "", ""] and all(lines[i] for i in (0, 1, 6, 7))
    assert result.translations[1].hypotheses[0].tokens == [EOS_ID]


def test_max_length_is_a_times_source_plus_b(checkpoint, tmp_path):
    result = generate(options(checkpoint, input=write(tmp_path / "in.en", LINES), max_len_a=0.0, max_len_b=3,
                              min_len=3, nbest=4))
    assert {len(h.tokens) for t in result.translations for h in t.hypotheses} == {4}  # 3 tokens + EOS
    _, vocabs = prepare_model(checkpoint, torch.device("cpu"))
    limit = [int(1.5 * len(vocabs.source.encode(line)) + 1) for line in LINES]
    result = generate(options(checkpoint, input=str(tmp_path / "in.en"), max_len_a=1.5, max_len_b=1))
    assert all(len(t.hypotheses[0].tokens) <= n + 1 for t, n in zip(result.translations, limit))
    assert any(len(t.hypotheses[0].tokens) == n + 1 for t, n in zip(result.translations, limit))


def test_nbest_fairseq_format_and_print_scores(checkpoint, tmp_path):
    source = write(tmp_path / "in.en", ["the number four", "five"])
    out = tmp_path / "out.txt"
    generate(options(checkpoint, input=source, nbest=2, format="fairseq", output=str(out)))
    lines = out.read_text(encoding="utf-8").splitlines()
    assert [line.split("\t")[0] for line in lines] == ["S-0", "H-0", "D-0", "P-0", "H-0", "D-0", "P-0",
                                                       "S-1", "H-1", "D-1", "P-1", "H-1", "D-1", "P-1"]
    assert float(lines[1].split("\t")[1]) >= float(lines[4].split("\t")[1])
    assert len(lines[3].split("\t")[1].split()) == len(lines[1].split("\t")[2].split()) + 1  # + EOS
    generate(options(checkpoint, input=source, print_scores=True, output=str(out)))
    scored = [line.split("\t") for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(scored) == 2 and all(len(parts) == 2 and float(parts[0]) < 0 for parts in scored)


def test_split_reference_is_in_fairseq_format(data_dir, checkpoint, tmp_path):
    out = tmp_path / "out.txt"
    generate(options(checkpoint, data=str(data_dir), format="fairseq", output=str(out)))
    kinds = [line.split("\t")[0].split("-")[0] for line in out.read_text(encoding="utf-8").splitlines()]
    assert kinds[:5] == ["S", "T", "H", "D", "P"] and len(kinds) == 5 * 30


def test_score_reference_uses_the_raw_reference_and_falls_back_to_the_split(data_dir, checkpoint, tmp_path, caplog):
    # The raw reference file made of the model's own translations: scored against it, BLEU is 100;
    # against the split's target side (the fallback) it is what the model really scores.
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    generate(options(checkpoint, data=str(copy), output=str(tmp_path / "h")))
    reference = tmp_path / "test.de"
    shutil.copy(tmp_path / "h", reference)
    datadir = DataDir.open(copy)
    datadir.meta.splits["test"].target_file = str(reference)
    datadir.meta.save(copy)
    result = generate(options(checkpoint, data=str(copy), score_reference=True, output=str(tmp_path / "h")))
    assert [m.name for m in result.scores] == ["BLEU"] and result.scores[0].score == pytest.approx(100.0)

    reference.unlink()
    fallback = generate(options(checkpoint, data=str(copy), score_reference=True, output=str(tmp_path / "h2")))
    hypotheses = (tmp_path / "h2").read_text(encoding="utf-8").splitlines()
    vocab, split = datadir.vocabulary("de"), datadir.split("test")
    decoded = [vocab.decode(split.target[i]) for i in range(len(split))]
    assert "raw reference file" in caplog.text
    assert fallback.scores[0].score == score(hypotheses, [decoded])[0].score < 100.0


def test_score_reference_takes_the_bleu_tokenizer_and_case(data_dir, checkpoint, tmp_path):
    default = generate(options(checkpoint, data=str(data_dir), score_reference=True, output=str(tmp_path / "h")))
    assert "|tok:13a|" in default.scores[0].signature  # sacreBLEU's choice for German
    chosen = generate(options(checkpoint, data=str(data_dir), score_reference=True, output=str(tmp_path / "h"),
                              tokenize="char", lowercase=True))
    raw = (tmp_path / "h").read_text(encoding="utf-8").splitlines()
    reference = open(DataDir.open(data_dir).meta.splits["test"].target_file, encoding="utf-8").read().splitlines()
    expected = score(raw, [reference], options=MetricOptions("char", lowercase=True))[0]
    assert "|tok:char|" in chosen.scores[0].signature and "case:lc" in chosen.scores[0].signature
    assert chosen.scores[0].score == expected.score != default.scores[0].score


def test_sampling_is_reproducible_through_generate(checkpoint, tmp_path):
    source = write(tmp_path / "in.en", LINES)
    first, again, other = (best_tokens(generate(options(checkpoint, input=source, sampling=True, seed=seed, beam=1)))
                           for seed in (3, 3, 4))
    assert first == again and first != other


def test_int8_quantization_runs_and_mostly_agrees(checkpoint, data_dir):
    fp32 = generate(options(checkpoint, data=str(data_dir), precision="fp32", output="/dev/null"))
    int8 = generate(options(checkpoint, data=str(data_dir), quantize="int8", output="/dev/null"))  # precision auto
    model, _ = prepare_model(checkpoint, torch.device("cpu"), "int8")
    quantized = [m for m in model.modules() if isinstance(m, Int8Linear)]
    # every linear layer of both stacks, and each decoder self-attention's q, k and v also as one
    # (nmt/generation/fused_layers.py); each first feed-forward layer has its ReLU
    assert len(quantized) == 2 * (4 + 2) + 2 * (4 + 4 + 2) + 1 + 2
    assert all(block.fc1.relu for block in model.modules() if isinstance(block, FeedForward))
    assert model.output_layer in quantized  # the output projection too
    agree = sum(a == b for a, b in zip(best_tokens(fp32), best_tokens(int8)))
    assert agree >= len(fp32.translations) // 2


def test_int8_decodes_on_the_cpu_in_fp32_whatever_auto_would_pick():
    # auto resolves to bf16 on CPUs with avx512_bf16: int8 layers cannot take bf16 inputs.
    int8 = InferenceDeviceOptions(device="auto", precision="auto", quantize="int8")
    assert inference_device(int8)[:2] == (torch.device("cpu"), "fp32")
    with pytest.raises(NmtError, match="int8 computes in fp32"):
        InferenceDeviceOptions(device="auto", precision="bf16", quantize="int8")
    with pytest.raises(NmtError, match="int8 is for CPU"):
        InferenceDeviceOptions(device="cuda", precision="auto", quantize="int8")


def test_bf16_generation_runs_on_cpu(checkpoint, data_dir):
    result = generate(options(checkpoint, data=str(data_dir), precision="bf16", output="/dev/null"))
    assert len(result.translations) == 30 and all(t.hypotheses for t in result.translations)


def test_cli_writes_only_translations_to_stdout(checkpoint, data_dir, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "generate", str(data_dir), "--path", str(checkpoint),
                             "--max-len-b", "5", "--score-reference")
    assert code == 0
    assert len(out.splitlines()) == 30
    assert "translated 30 sentences" in err and "BLEU" in err and "BLEU" not in out


@pytest.mark.parametrize("args,message", [
    (["-i", "-", "--path", "missing.pt"], "checkpoint not found"),
    (["DATA", "--split", "nope"], "has no split 'nope'"),
    (["DATA", "--beam", "2", "--nbest", "3"], "--nbest"),
    (["--path", "CKPT"], "give either DATA_DIR"),
    (["-i", "-", "--score-reference"], "--score-reference needs a binarized split"),
    (["-i", "-", "--path", "CORRUPT"], "corrupt or not an nmt checkpoint"),
])
def test_cli_errors_are_one_line(checkpoint, data_dir, tmp_path, monkeypatch, capsys, args, message):
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(checkpoint.read_bytes()[:1000])
    names = {"DATA": str(data_dir), "CKPT": str(checkpoint), "CORRUPT": str(corrupt)}
    args = [names.get(arg, arg) for arg in args]
    if "--path" not in args:
        args += ["--path", str(checkpoint)]
    output = tmp_path / "kept.txt"
    output.write_text("old translations\n")
    code, out, err = run_cli(monkeypatch, capsys, "generate", *args, "--output", str(output))
    assert code == 1 and out == ""
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert output.read_text() == "old translations\n"  # a failed run leaves the old output whole


@pytest.mark.parametrize("output_flag, clash", [("--output", "--input"), ("--output", "--path"),
                                                ("--print-attention", "--input"), ("--output", "--print-attention")])
def test_an_output_that_is_an_input_is_refused_and_left_whole(checkpoint, tmp_path, monkeypatch, capsys,
                                                              output_flag, clash):
    model = tmp_path / "model.pt"
    model.write_bytes(checkpoint.read_bytes())
    source = tmp_path / "in.en"
    source.write_text("five\n")
    args = {"--input": str(source), "--path": str(model), "--output": str(tmp_path / "out.txt")}
    if clash == "--print-attention":  # both outputs on one file
        (tmp_path / "other.txt").write_text("mine\n")
        args["--output"] = args["--print-attention"] = str(tmp_path / "other.txt")
    else:
        args[output_flag] = args[clash]
    before = {path: path.read_bytes() for path in tmp_path.iterdir()}
    code, out, err = run_cli(monkeypatch, capsys, "generate", *[item for pair in args.items() for item in pair])
    assert code == 1 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert f"{output_flag} " in err and f"is also the {clash}" in err
    assert {path: path.read_bytes() for path in tmp_path.iterdir()} == before


def test_the_raw_text_of_a_translated_split_is_never_an_output(data_dir, checkpoint):
    """Else --score-reference would read the hypotheses back as the reference (BLEU 100)."""
    reference = Path(DataDir.open(data_dir).meta.splits["test"].target_file)
    before = reference.read_bytes()
    for flag in ("output", "print_attention"):
        with pytest.raises(NmtError, match=f"--{flag.replace('_', '-')} .*test.de is also the raw text of the split"):
            generate(options(checkpoint, data=str(data_dir), score_reference=True, **{flag: str(reference)}))
    assert reference.read_bytes() == before


@pytest.mark.slow
def test_console_script_reads_stdin_and_reports_errors_without_traceback(checkpoint):
    command = [sys.executable, "-m", "nmt", "generate", "-i", "-", "--path", str(checkpoint), "--max-len-b", "5"]
    result = subprocess.run(command, input="five\n\nthe number four\n", capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")[:-1]
    assert len(lines) == 3 and lines[1] == "" and lines[0] and lines[2]
    result = subprocess.run(command[:-4] + ["--path", "missing.pt"], input="five\n", capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr.startswith("error: checkpoint not found")
    assert "Traceback" not in result.stderr


def test_inputs_longer_than_max_positions_are_refused(data_dir, tmp_path, monkeypatch, capsys):
    vocab = DataDir.open(data_dir).vocabulary("en")
    arch = get_arch("transformer_tiny")
    config = resolve_config(arch.config, {"d_model": 32, "ffn_dim": 64, "max_positions": 6})
    model = build_model(arch.model_name, config, len(vocab), len(vocab), PAD_ID)
    path = tmp_path / "short.pt"
    save_checkpoint(path, model_state(model, "transformer_tiny", config, Vocabularies("en", "de", vocab, vocab)))
    code, out, err = run_cli(monkeypatch, capsys, "generate", "-i", "-", "--path", path,
                             stdin="five\nI counted to nine thousand and one yesterday.\n")
    assert code == 1 and out == ""
    assert_one_line_error(err, "input line 2 has", "over the model's max_positions 6")
    with pytest.raises(NmtError, match="a sequence of 7 tokens is over the model's max_positions 6"):
        model(torch.full((1, 7), EOS_ID), torch.full((1, 2), EOS_ID))


def test_empty_input_gives_empty_output_and_success(checkpoint, tmp_path, monkeypatch, capsys):
    """As fairseq-interactive: a sharded pipeline has empty shards; an empty file or stdin is no error."""
    empty = tmp_path / "empty.en"
    empty.write_text("")
    output = tmp_path / "out.de"
    output.write_text("stale\n")
    code, out, err = run_cli(monkeypatch, capsys, "generate", "-i", str(empty), "--path", str(checkpoint),
                             "-o", str(output))
    assert code == 0 and output.read_text() == "" and "translated 0 sentences" in err
    code, out, err = run_cli(monkeypatch, capsys, "generate", "-i", "-", "--path", str(checkpoint), stdin="")
    assert code == 0 and out == ""
    result = run_nmt("generate", "-i", "-", "--path", checkpoint, stdin="")  # a real (empty) pipe: streaming
    assert result.returncode == 0 and result.stdout == "", result.stderr


def test_the_log_counts_one_sentence_in_the_singular(checkpoint, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "generate", "-i", "-", "--path", str(checkpoint), stdin="one\n")
    assert code == 0 and "translated 1 sentence in" in err


def test_max_tokens_0_sizes_batches_for_the_device():
    """8,000 source tokens x beam on a CPU, 32,000 on a GPU; a given budget is kept on both; None
    (the server's, with --batch-size) sets no token limit."""
    from nmt.generation.inference import plan_workload

    sources = [np.arange(5, 12) for _ in range(10)]
    search = SearchOptions(beam=4)
    budgets = {device: plan_workload(sources, search, BatchingOptions(), None, device_type=device).max_tokens
               for device in ("cpu", "cuda")}
    assert budgets == {"cpu": 8000 // 4, "cuda": 32000 // 4}
    assert plan_workload(sources, search, BatchingOptions(max_tokens=400), None, workers=2,
                         device_type="cuda").max_tokens == 400 // (4 * 2)
    assert plan_workload(sources, search, BatchingOptions(max_tokens=None, batch_size=3), None).max_tokens is None
