"""`nmt generate -i -` translates lines as they arrive: through a real pipe, and the reader alone."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import numbers_pairs
from test_translator import tiny_checkpoint

from nmt.data.vocabulary import Vocabulary
from nmt.errors import NmtError
from nmt.generation.streaming import LineReader

LINES = ["five", "", "Turn to page twelve.", "the number four", "seven"]
GIVE_UP = 120  # seconds: only so that a broken build fails instead of hanging


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    vocab = Vocabulary.train([side for pair in numbers_pairs(300, seed=1) for side in pair], vocab_size=120)
    return tiny_checkpoint(tmp_path_factory.mktemp("streaming") / "model.pt", vocab)


def read_line(process: subprocess.Popen) -> str:
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    if not selector.select(GIVE_UP):
        raise AssertionError("no translation came back while stdin stayed open")
    return process.stdout.readline().decode("utf-8")


def generate_command(checkpoint: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "nmt", "generate", "-i", "-", "--path", str(checkpoint), "--max-len-b", "5", *args]


def test_each_line_is_answered_before_stdin_closes(checkpoint, tmp_path):
    source = tmp_path / "in.en"
    source.write_text("".join(line + "\n" for line in LINES), encoding="utf-8")
    with open(source, "rb") as handle:  # a regular file: read whole, batched by length
        expected = subprocess.run(generate_command(checkpoint), stdin=handle, capture_output=True, check=True).stdout
    expected_lines = expected.decode("utf-8").split("\n")[:-1]
    assert len(expected_lines) == len(LINES) and expected_lines[1] == ""

    process = subprocess.Popen(generate_command(checkpoint), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    try:
        answers = []
        for line in LINES:
            process.stdin.write(line.encode("utf-8") + b"\n")
            process.stdin.flush()
            answers.append(read_line(process).removesuffix("\n"))
            assert process.poll() is None  # still waiting for more input
        process.stdin.close()
        assert process.wait(GIVE_UP) == 0, process.stderr.read().decode()
        assert process.stdout.read() == b""
    finally:
        process.kill()
    assert answers == expected_lines


def test_buffer_size_and_fairseq_format_number_lines_across_batches(checkpoint):
    text = "".join(line + "\n" for line in LINES)
    plain = subprocess.run(generate_command(checkpoint), input=text, capture_output=True, text=True, check=True)
    buffered = subprocess.run(generate_command(checkpoint, "--buffer-size", "2", "--format", "fairseq"), input=text,
                              capture_output=True, text=True, check=True)
    sources = [line for line in buffered.stdout.splitlines() if line.startswith("S-")]
    assert sources == [f"S-{i}\t{line}" for i, line in enumerate(LINES)]
    detok = [line.split("\t")[2] for line in buffered.stdout.splitlines() if line.startswith("D-")]
    assert detok == plain.stdout.split("\n")[:-1]


def test_reader_takes_what_is_waiting_or_waits_for_a_full_buffer():
    read_end, write_end = os.pipe()
    reader = LineReader(read_end)
    os.write(write_end, b"a\nb\r\nc")
    assert reader.next_batch() == ["a", "b"]  # "c" has no line end yet
    os.write(write_end, b"\nd\n")
    assert reader.next_batch(1) == ["c"]
    late = threading.Timer(0.2, os.write, (write_end, b"e\n"))
    late.start()
    assert reader.next_batch(2) == ["d", "e"]  # blocks until the second line arrives
    late.join()
    os.write(write_end, b"\n\xff\n")
    os.close(write_end)
    assert reader.next_batch(1) == [""]
    with pytest.raises(NmtError, match="line 7 is not valid UTF-8"):
        reader.next_batch()
    assert reader.next_batch() == []  # the end of input
    os.close(read_end)


def test_last_line_without_line_end_is_kept():
    read_end, write_end = os.pipe()
    os.write(write_end, "x\nÜber".encode())
    os.close(write_end)
    reader = LineReader(read_end)
    assert reader.next_batch(5) == ["x", "Über"] and reader.next_batch() == []
    os.close(read_end)


def test_sampling_draws_on_across_a_streams_batches(checkpoint):
    """Each batch of a stream continues the seeded draws: six copies of a line, one per batch, get samples
    as varied as in one batch, and the same ones again with the same seed."""
    text = "Turn to page twelve.\n" * 6
    command = generate_command(checkpoint, "--sampling", "--beam", "1", "--buffer-size", "1", "--seed", "3")
    first = subprocess.run(command, input=text, capture_output=True, text=True, check=True).stdout.splitlines()
    again = subprocess.run(command, input=text, capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(first) == 6 and len(set(first)) > 1  # not one sample repeated by a re-seeded generator
    assert again == first
