"""Say each figure once: every ratio ("1.08x") and BLEU figure in README.md is one that
docs/performance.md or docs/results.md states, with the same value, for the same machine.

A ratio is a number followed by "x" ("1.08x", "9.2x"). A BLEU figure is a number next to "BLEU"
("38.93 BLEU", "BLEU 38.93", "39.06 BLEU against 39.18"), a number in a table column whose header
names BLEU, or a number in a table row whose first cell names BLEU.

A figure's machine is the one its table row names (else its section's heading); in README.md a
paragraph may name it too. A README figure with a machine must be stated for that machine: in
performance.md the section headed with its name, in results.md the table row naming it. One
without a machine may be stated anywhere in the two files.
"""

import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SOURCES = [ROOT / "docs" / "performance.md", ROOT / "docs" / "results.md"]

MACHINES = ["Xeon", "Zen 5", "Zen 4", "Zen 3", "Zen 1", "VNNI", "H200", "H100"]
NUMBER = r"\d+(?:\.\d+)?"
DECIMAL = r"\d+\.\d+"
RATIO = re.compile(rf"(?<![\w.])({NUMBER})x(?!\w)")
BLEU_AFTER = re.compile(rf"(?<![\w.])({DECIMAL})\s+(?:cased\s+|lowercased\s+)?(?:sacre)?BLEU\b")
BLEU_BEFORE = re.compile(rf"\bBLEU\b[\s:=]+(?:of\s+)?({DECIMAL})(?![\w.])")
BLEU_AGAINST = re.compile(rf"\bBLEU,?\s+(?:against|vs\.?|and)\s+({DECIMAL})(?![\w.])")
CELL_NUMBER = re.compile(rf"(?<![\w.])({DECIMAL})(?![\w.])")
CELL_SPLIT = re.compile(r"(?<!\\)\|")


@dataclass(frozen=True)
class Figure:
    kind: str  # "ratio" or "BLEU"
    text: str  # as written: "1.08", "38.10"
    machines: frozenset[str]

    @property
    def value(self) -> Decimal:
        return Decimal(self.text).normalize()

    def __str__(self) -> str:
        where = f" ({', '.join(sorted(self.machines))})" if self.machines else ""
        return f"{self.kind} {self.text}{'x' if self.kind == 'ratio' else ''}{where}"


def machines_in(text: str) -> frozenset[str]:
    return frozenset(m for m in MACHINES if re.search(rf"\b{m}\b", text))


def blocks(text: str):
    """(heading machines, lines) of each paragraph or table outside fenced code."""
    heading, block, fenced = frozenset(), [], False
    for line in text.splitlines() + [""]:
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.startswith("#") or not line.strip():
            if block:
                yield heading, block
            block = []
            if line.startswith("## ") or line.startswith("# "):
                heading = machines_in(line)
            elif line.startswith("#"):
                heading = heading | machines_in(line)
            continue
        block.append(line)


def figures(text: str, paragraphs_name_machines: bool) -> list[Figure]:
    """The ratios and BLEU figures of ``text``, each with its machines."""
    found = []
    for heading, lines in blocks(text):
        if all(line.lstrip().startswith("|") for line in lines):
            rows = [[cell.strip() for cell in CELL_SPLIT.split(line.strip())[1:-1]] for line in lines]
            header, *rows = [row for row in rows if not all(re.fullmatch(r":?-{3,}:?", c) for c in row)]
            columns = [i for i, name in enumerate(header) if "BLEU" in name]
            for row in rows:
                machines = machines_in(" ".join(row)) or heading
                found += [Figure("ratio", m, machines) for m in RATIO.findall(" ".join(row))]
                cells = row if row and "BLEU" in row[0] else [row[i] for i in columns if i < len(row)]
                for cell in cells:
                    found += [Figure("BLEU", m, machines) for m in CELL_NUMBER.findall(RATIO.sub("", cell))]
        else:
            paragraph = " ".join(line.strip() for line in lines)
            machines = heading | machines_in(paragraph) if paragraphs_name_machines else heading
            found += [Figure("ratio", m, machines) for m in RATIO.findall(paragraph)]
            found += [Figure("BLEU", m, machines) for pattern in (BLEU_AFTER, BLEU_BEFORE, BLEU_AGAINST)
                      for m in pattern.findall(paragraph)]
    return found


def unmatched(readme: str, sources: list[str]) -> list[str]:
    """The README's figures that no source states with the same value for the same machine."""
    stated = [figure for text in sources for figure in figures(text, paragraphs_name_machines=False)]
    missing = []
    for figure in figures(readme, paragraphs_name_machines=True):
        if not any(s.kind == figure.kind and s.value == figure.value
                   and (not figure.machines or figure.machines & s.machines) for s in stated):
            missing.append(str(figure))
    return list(dict.fromkeys(missing))


def test_extraction_finds_each_kind():
    text = ("## AMD EPYC Zen 4\n\nnmt 1.08x, **9.2x**; 39.06 BLEU against 39.18; BLEU 27.27; cased sacreBLEU\n\n"
            "| machine | BLEU |\n| --- | ---: |\n| Zen 3 | 38.10 (38.45) |\n\n"
            "| measure | result |\n| --- | --- |\n| BLEU of int8 | 27.35 (fp32: 27.43), 1.5x |\n\n"
            "```\nBLEU = 12.34 and 7.7x\n```\n")
    got = {(f.kind, f.text, tuple(sorted(f.machines))) for f in figures(text, paragraphs_name_machines=False)}
    zen4, zen3 = ("Zen 4",), ("Zen 3",)
    assert got == {("ratio", "1.08", zen4), ("ratio", "9.2", zen4), ("BLEU", "39.06", zen4),
                   ("BLEU", "39.18", zen4), ("BLEU", "27.27", zen4), ("BLEU", "38.10", zen3),
                   ("BLEU", "38.45", zen3), ("BLEU", "27.35", zen4), ("BLEU", "27.43", zen4), ("ratio", "1.5", zen4)}


def test_readme_states_figures():
    found = figures(README.read_text(encoding="utf-8"), paragraphs_name_machines=True)
    kinds = [f.kind for f in found]
    assert kinds.count("ratio") >= 3 and kinds.count("BLEU") >= 3, "too few figures in README.md: check the patterns"


def test_every_readme_figure_is_stated_in_performance_or_results():
    missing = unmatched(README.read_text(encoding="utf-8"), [p.read_text(encoding="utf-8") for p in SOURCES])
    assert not missing, ("README.md states figures that docs/performance.md and docs/results.md do not state for "
                         f"the same machine (say each figure once, there, and copy it exactly): {'; '.join(missing)}")


def test_a_planted_wrong_figure_fails():
    readme = README.read_text(encoding="utf-8")
    sources = [p.read_text(encoding="utf-8") for p in SOURCES]
    assert not unmatched(readme, sources)
    planted = readme + "\nnmt decodes at 1.77x CTranslate2 and reaches 41.23 BLEU.\n"
    assert unmatched(planted, sources) == ["ratio 1.77x", "BLEU 41.23"]
    # a figure of another machine: Zen 3's recipe BLEU in Zen 4's row
    assert "| AMD EPYC Zen 4, 2 cores (bf16) | CPU | 115 min | 40.23 |" in readme
    swapped = readme.replace("| AMD EPYC Zen 4, 2 cores (bf16) | CPU | 115 min | 40.23 |",
                             "| AMD EPYC Zen 4, 2 cores (bf16) | CPU | 115 min | 38.10 |")
    assert unmatched(swapped, sources) == ["BLEU 38.10 (Zen 4)"]
