"""The Python API: `from nmt import Translator` gives what `nmt generate` gives, with scores."""

from __future__ import annotations

import multiprocessing
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import numbers_pairs

import nmt.generation.inference as inference_module
from nmt import Translator
from nmt.checkpoint.format import Vocabularies, model_state, save_checkpoint
from nmt.data.vocabulary import PAD_ID, Vocabulary
from nmt.errors import NmtError
from nmt.generation.generate import generate
from nmt.generation.options import GenerateOptions
from nmt.models.registry import build_model, get_arch, resolve_config
from nmt.options import build

README = Path(__file__).resolve().parents[1] / "README.md"
LINES = ["five", "Turn to page twelve.", "", "the number four", "My room number is eighty-two.", "seven"]


def tiny_checkpoint(path: Path, vocab: Vocabulary, seed: int = 0, **model: Any) -> Path:
    """An untrained but deterministic tiny model (peaky distributions: no near-ties)."""
    torch.manual_seed(seed)
    arch = get_arch("transformer_tiny")
    config = resolve_config(arch.config, {"d_model": 32, "ffn_dim": 64, **model})
    model = build_model(arch.model_name, config, len(vocab), len(vocab), PAD_ID)
    with torch.no_grad():
        model.tgt_embed.weight.mul_(4.0)
    save_checkpoint(path, model_state(model, "transformer_tiny", config, Vocabularies("en", "de", vocab, vocab)))
    return path


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary.train([side for pair in numbers_pairs(300, seed=1) for side in pair], vocab_size=120)


@pytest.fixture(scope="module")
def checkpoint(vocab, tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("translator") / "model.pt", vocab)


def generate_lines(checkpoint: Path, tmp_path: Path, lines: list[str], **options) -> list[str]:
    source, output = tmp_path / "in.en", tmp_path / "out.de"
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    generate(build(GenerateOptions, {"path": [str(checkpoint)], "input": str(source), "output": str(output),
                                     **options}), show_progress=False)
    return output.read_text(encoding="utf-8").split("\n")[:-1]


def test_translate_equals_generate_with_the_same_defaults(checkpoint, tmp_path):
    translator = Translator.from_checkpoint(checkpoint, device="cpu")
    assert translator.translate(LINES) == generate_lines(checkpoint, tmp_path, LINES)
    assert translator.translate(LINES, beam=1, max_len_b=3) == generate_lines(checkpoint, tmp_path, LINES, beam=1,
                                                                              max_len_b=3)
    assert translator.translate(LINES, beam=1, max_len_b=3) != translator.translate(LINES)  # options are used
    assert translator.translate(line for line in LINES) == translator.translate(LINES)  # any iterable, read once


def test_hypotheses_carry_scores_and_per_token_scores(checkpoint, tmp_path):
    translator = Translator.from_checkpoint(checkpoint, device="cpu")
    nbest = translator.hypotheses(LINES, beam=3, nbest=3)
    assert [len(hyps) for hyps in nbest] == [3] * len(LINES)
    scored = generate_lines(checkpoint, tmp_path, LINES, beam=3, nbest=3, print_scores=True)
    assert [f"{h.score:.4f}\t{h.text}" for hyps in nbest for h in hyps] == scored
    for hyps in nbest:
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        for h in hyps:
            assert len(h.token_scores) == len(h.pieces) + 1  # + EOS
    long = nbest[1][0]  # GNMT length penalty ((5 + |Y|) / 6) ** 0.6 over the summed token scores
    assert long.score == pytest.approx(sum(long.token_scores) / ((5 + len(long.token_scores)) / 6) ** 0.6, rel=1e-5)


def test_bad_calls_are_clear_errors(checkpoint):
    translator = Translator.from_checkpoint(checkpoint, device="cpu")
    with pytest.raises(NmtError, match="list of strings"):
        translator.translate("five")
    with pytest.raises(NmtError, match="list of strings"):
        translator.translate(["five", 5])
    with pytest.raises(NmtError, match="unknown translation option.*beam_size"):
        translator.translate(["five"], beam_size=2)
    with pytest.raises(NmtError, match="--nbest"):
        translator.hypotheses(["five"], beam=2, nbest=3)
    with pytest.raises(NmtError, match="checkpoint not found"):
        Translator.from_checkpoint("missing.pt")


def test_readme_python_example_runs(checkpoint, tmp_path, monkeypatch, capsys):
    section = README.read_text(encoding="utf-8").split("## Python API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)[1]
    assert "nmt-demo/checkpoints/averaged.pt" in code
    monkeypatch.chdir(tmp_path)
    exec(compile(code.replace("nmt-demo/checkpoints/averaged.pt", str(checkpoint)), "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[:2] == Translator.from_checkpoint(checkpoint, device="cpu").translate(
        ["Turn to page twelve.", "My room number is four hundred eleven."])


def test_unknown_characters_are_reported_in_one_line(checkpoint, caplog, tmp_path):
    translator = Translator.from_checkpoint(checkpoint, device="cpu")
    translator.translate(["five", "the number four"])
    assert "unknown" not in caplog.text
    translator.translate(["five 東京 😀x", "seven", "Ω"])
    (warning,) = [r.getMessage() for r in caplog.records if "unknown" in r.getMessage()]
    assert warning.startswith("3 input token(s) in 2 sentence(s) were unknown to the en vocabulary")
    assert warning.endswith("(characters it cannot represent: Ω 京 東 😀)")
    caplog.clear()
    translator.translate(["five\x00six"])  # a control character is named, not printed raw
    (warning,) = [r.getMessage() for r in caplog.records if "unknown" in r.getMessage()]
    assert warning.endswith("(characters it cannot represent: U+0000)")


def test_generate_warns_on_stderr_not_stdout(checkpoint, tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "nmt", "generate", "-i", "-", "--path", str(checkpoint), "-q"],
                            input="five\n東京\n", capture_output=True, text=True)
    assert result.returncode == 0 and len(result.stdout.split("\n")) == 3
    assert "1 input token(s) in 1 sentence(s) were unknown" in result.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="workers are forked processes on Linux only")
def test_the_api_forks_its_workers_only_when_no_other_thread_runs(checkpoint, monkeypatch):
    """As `nmt generate` does, unless the program has other threads, which may hold a lock at the fork;
    workers forked before then serve its later calls (no fork needed)."""
    translator = Translator.from_checkpoint(checkpoint, device="cpu")
    processes = multiprocessing.get_context("fork").SimpleQueue()
    search = inference_module.beam_search

    def watched(*args, **kwargs):
        processes.put(os.getpid())
        return search(*args, **kwargs)

    monkeypatch.setattr(inference_module, "beam_search", watched)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # two workers of one thread each (set for real: a
    # forked worker that kept the parent's OpenMP threads would wait on them forever)
    sentences = [f"Turn to page {n}." for n in ("one", "two", "three", "four", "five", "six")]
    decoded_in = []
    for threads in (2, 1, 2):
        monkeypatch.setattr(threading, "active_count", lambda: threads)
        assert translator.translate(sentences, batch_size=2, workers=2)
        seen = set()
        while not processes.empty():
            seen.add(processes.get())
        decoded_in.append(seen)
    workers = set(translator.kept_workers.forked.pool._processes)
    assert decoded_in[0] == {os.getpid()} and decoded_in[1] <= workers and decoded_in[2] <= workers
    assert len(workers) == 2 and os.getpid() not in workers and decoded_in[1] and decoded_in[2]
