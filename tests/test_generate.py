"""nmt generate end to end: inputs, outputs, order, formats, quantization, errors."""

import subprocess
import sys

import pytest
import torch

from nmt.checkpoint import Vocabularies, model_state, save_checkpoint
from nmt.data.dataset import DataDir
from nmt.data.vocabulary import PAD_ID
from nmt.generation.generator import GenerateOptions, generate
from nmt.models.registry import build_model, get_arch, resolve_config


@pytest.fixture(scope="module")
def checkpoint(tiny_data_dir, tmp_path_factory):
    """An untrained but deterministic tiny model over the tiny data dir's vocabulary."""
    datadir = DataDir.open(tiny_data_dir)
    vocab = datadir.vocabulary("en")
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
    return GenerateOptions(path=str(checkpoint), max_len_b=8, progress=False, **kwargs)


def texts(translations) -> list[str]:
    return [t.hypotheses[0].tokens for t in translations]


def test_split_translations_keep_input_order(tiny_data_dir, checkpoint, tmp_path):
    out = tmp_path / "hyp.txt"
    result = generate(options(checkpoint, data=str(tiny_data_dir), split="valid", output=str(out)))
    assert [t.index for t in result] == list(range(40))
    vocab = DataDir.open(tiny_data_dir).vocabulary("de")
    assert out.read_text(encoding="utf-8").splitlines() == [vocab.decode(t.hypotheses[0].tokens) for t in result]


def test_batch_size_and_input_order_do_not_change_translations(checkpoint, tmp_path):
    lines = ["five", "Turn to page twelve.", "the number four", "My room number is eighty-two.", "seven",
             "I counted to nine thousand and one yesterday.", "She said three twice.", "the number sixty"]
    forward, backward = tmp_path / "a.en", tmp_path / "b.en"
    forward.write_text("\n".join(lines) + "\n", encoding="utf-8")
    backward.write_text("\n".join(reversed(lines)) + "\n", encoding="utf-8")
    by_64 = generate(options(checkpoint, input=str(forward), batch_size=64, max_tokens=None))
    by_1 = generate(options(checkpoint, input=str(forward), batch_size=1, max_tokens=None))
    reversed_input = generate(options(checkpoint, input=str(backward)))
    assert texts(by_64) == texts(by_1) == texts(reversed_input)[::-1]


def test_raw_input_order_is_kept_whatever_the_lengths(checkpoint, tmp_path):
    lines = ["Turn to page twelve.", "the number four", "I counted to nine thousand and one yesterday.", "five"]
    source = tmp_path / "in.en"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    together = generate(options(checkpoint, input=str(source)))
    assert [t.source for t in together] == lines
    for line, translation in zip(lines, together):
        single = tmp_path / "one.en"
        single.write_text(line + "\n", encoding="utf-8")
        assert texts(generate(options(checkpoint, input=str(single)))) == [translation.hypotheses[0].tokens]


def test_nbest_and_fairseq_format(checkpoint, tmp_path):
    source = tmp_path / "in.en"
    source.write_text("the number four\nfive\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    generate(options(checkpoint, input=str(source), nbest=2, format="fairseq", output=str(out)))
    lines = out.read_text(encoding="utf-8").splitlines()
    assert [line.split("\t")[0] for line in lines] == ["S-0", "H-0", "D-0", "P-0", "H-0", "D-0", "P-0",
                                                       "S-1", "H-1", "D-1", "P-1", "H-1", "D-1", "P-1"]
    first, second = float(lines[1].split("\t")[1]), float(lines[4].split("\t")[1])
    assert first >= second


def test_int8_quantization_runs_and_mostly_agrees(checkpoint, tiny_data_dir):
    fp32 = generate(options(checkpoint, data=str(tiny_data_dir), split="valid"))
    int8 = generate(options(checkpoint, data=str(tiny_data_dir), split="valid", quantize="int8"))
    assert len(int8) == len(fp32)
    agree = sum(a == b for a, b in zip(texts(fp32), texts(int8)))
    assert agree >= len(fp32) // 2


def test_bf16_generation_runs_on_cpu(checkpoint, tiny_data_dir):
    result = generate(options(checkpoint, data=str(tiny_data_dir), split="valid", precision="bf16"))
    assert len(result) == 40 and all(t.hypotheses for t in result)


def run_nmt(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nmt", "generate", *args], capture_output=True, text=True, input=stdin)


def test_cli_reads_stdin_and_writes_stdout(checkpoint):
    result = run_nmt("-i", "-", "--path", str(checkpoint), "--max-len-b", "5", "-q", stdin="five\nthe number four\n")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2


@pytest.mark.parametrize("args,message", [
    (["--path", "missing.pt", "-i", "-"], "checkpoint not found"),
    (["--split", "nope"], "has no split 'nope'"),
    (["--beam", "2", "--nbest", "3"], "--nbest"),
])
def test_cli_errors_are_one_line(checkpoint, tiny_data_dir, args, message):
    base = [str(tiny_data_dir), "--path", str(checkpoint)] if "-i" not in args else []
    result = run_nmt(*base, *args, stdin="")
    assert result.returncode == 1
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_cli_rejects_empty_input_and_corrupt_checkpoints(checkpoint, tmp_path):
    result = run_nmt("-i", "-", "--path", str(checkpoint), stdin="")
    assert result.returncode == 1 and "empty" in result.stderr
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(checkpoint.read_bytes()[:1000])
    result = run_nmt("-i", "-", "--path", str(corrupt), stdin="five\n")
    assert result.returncode == 1 and "corrupt or truncated" in result.stderr and "Traceback" not in result.stderr
