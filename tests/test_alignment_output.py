"""generate --print-alignment / --print-attention: parseable, within the sentences, one teacher-forced pass."""

from __future__ import annotations

import json

import pytest

from nmt.errors import NmtError
from nmt.generation.generate import generate as run_generation
from nmt.generation.options import GenerateOptions
from nmt.options import build


def options(**values) -> GenerateOptions:
    return build(GenerateOptions, values)


def generate(options: GenerateOptions) -> None:
    run_generation(options, show_progress=False)


LINES = ["one hundred and twenty three", "", "seven thousand four hundred", "nine"]


@pytest.fixture(scope="module")
def checkpoint(untrained_checkpoint):
    return untrained_checkpoint


@pytest.fixture()
def source(tmp_path):
    path = tmp_path / "in.en"
    path.write_text("".join(line + "\n" for line in LINES))
    return str(path)


def parse_pairs(column: str) -> list[tuple[int, int]]:
    return [tuple(map(int, pair.split("-"))) for pair in column.split()]


def test_plain_alignment_column_indexes_words_of_both_sides(checkpoint, source, tmp_path):
    out = tmp_path / "out"
    generate(options(path=[str(checkpoint)], input=source, output=str(out), print_alignment=True,
                             max_len_b=6))
    plain = tmp_path / "plain"
    generate(options(path=[str(checkpoint)], input=source, output=str(plain), max_len_b=6))
    lines = out.read_text().splitlines()
    assert len(lines) == len(LINES)
    for line, text, source_line in zip(lines, plain.read_text().splitlines(), LINES):
        translation, _, column = line.partition("\t")
        assert translation == text  # the alignment is added, the translation unchanged
        pairs = parse_pairs(column)
        assert len(pairs) == len(translation.split())  # one link per target word
        assert [t for _, t in pairs] == list(range(len(pairs)))
        assert all(0 <= s < len(source_line.split()) for s, _ in pairs)
    assert lines[1] == "\t"  # an empty line stays empty, with an empty alignment


def test_fairseq_format_has_an_a_line_per_hypothesis(checkpoint, source, tmp_path):
    out = tmp_path / "out"
    generate(options(path=[str(checkpoint)], input=source, output=str(out), print_alignment=True, nbest=2,
                             beam=2, format="fairseq", max_len_b=6))
    lines = out.read_text().splitlines()
    a_lines = [line for line in lines if line.startswith("A-")]
    d_lines = [line for line in lines if line.startswith("D-")]
    assert len(a_lines) == len(d_lines) == 2 * len(LINES)
    for a_line, d_line in zip(a_lines, d_lines):
        assert a_line.split("\t")[0][2:] == d_line.split("\t")[0][2:]
        pairs = parse_pairs(a_line.split("\t")[1]) if "\t" in a_line else []
        assert len(pairs) == len(d_line.split("\t")[2].split())


def test_print_attention_writes_one_json_line_per_input(checkpoint, source, tmp_path):
    jsonl = tmp_path / "attention.jsonl"
    generate(options(path=[str(checkpoint)], input=source, output=str(tmp_path / "out"), max_len_b=6,
                             print_attention=str(jsonl), alignment_layer=2))
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    assert records[0]["source"] == LINES[0].split()
    for record in records:
        matrix = record["attention"]
        assert len(matrix) == len(record["target"])
        assert all(len(row) == len(record["source"]) for row in matrix)
        assert all(0 < sum(row) <= 1.001 for row in matrix if record["source"])  # the rest went to EOS


def test_alignment_layer_is_checked(checkpoint, source, tmp_path):
    with pytest.raises(NmtError, match="--alignment-layer must be between 1 and 2"):
        generate(options(path=[str(checkpoint)], input=source, output=str(tmp_path / "o"),
                                 print_alignment=True, alignment_layer=3))
    assert not (tmp_path / "o").exists()
    with pytest.raises(NmtError, match="applies with --print-alignment"):
        options(path=[str(checkpoint)], input=source, alignment_layer=1)
