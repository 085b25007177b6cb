import gzip
import json
import urllib.error

import pytest
import sacrebleu
from conftest import run_nmt

from nmt import scoring
from nmt.errors import NmtError
from nmt.scoring import MetricOptions, format_results, language_of, parse_metrics, score, score_files

HYPOTHESES = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog!",
    "Ich habe einundzwanzig Äpfel gekauft.",
    "there is no reference like this one",
]
REFERENCES = [
    "The cat sat on a mat.",
    "The quick brown fox jumped over the lazy dog!",
    "Ich habe einundzwanzig Äpfel gekauft.",
    "This is a different sentence entirely.",
]
SECOND_REFERENCES = [
    "A cat was sitting on the mat.",
    "A quick brown fox jumps over a lazy dog.",
    "Ich kaufte einundzwanzig Äpfel.",
    "there is no reference like that one",
]


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_bleu_equals_sacrebleu_corpus_bleu():
    expected = sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES, SECOND_REFERENCES])
    (bleu,) = score(HYPOTHESES, [REFERENCES, SECOND_REFERENCES])
    assert bleu.name == "BLEU" and bleu.score == pytest.approx(expected.score, abs=1e-9)
    assert 20 < bleu.score < 90  # a non-trivial value, not 0 or 100
    assert "nrefs:2|case:mixed|eff:no|tok:13a|smooth:exp" in bleu.signature
    assert bleu.formatted.startswith(f"BLEU|{bleu.signature} = {bleu.score:.2f}")


def test_chrf_and_ter_match_sacrebleu_and_lowercase_is_applied():
    results = score(HYPOTHESES, [REFERENCES], metrics=["bleu", "chrf", "ter"])
    assert [result.name for result in results] == ["BLEU", "chrF2", "TER"]
    assert results[1].score == pytest.approx(sacrebleu.corpus_chrf(HYPOTHESES, [REFERENCES]).score)
    assert results[2].score == pytest.approx(sacrebleu.corpus_ter(HYPOTHESES, [REFERENCES]).score)
    upper = [line.upper() for line in HYPOTHESES]
    cased, lowered = score(upper, [REFERENCES]), score(upper, [REFERENCES], options=MetricOptions(lowercase=True))
    assert "case:lc" in lowered[0].signature
    assert lowered[0].score == pytest.approx(
        score(HYPOTHESES, [REFERENCES], options=MetricOptions(lowercase=True))[0].score)
    assert cased[0].score < lowered[0].score


@pytest.mark.slow
def test_line_count_mismatch_is_an_error_not_a_truncation(tmp_path):
    system = write(tmp_path / "hyp.txt", HYPOTHESES)
    short = write(tmp_path / "ref.txt", REFERENCES[:3])
    with pytest.raises(NmtError, match="hyp.txt has 4 lines but .*ref.txt has 3"):
        score_files(system, [short])
    with pytest.raises(NmtError, match="reference 1 has 3 lines but there are 4 hypotheses"):
        score(HYPOTHESES, [REFERENCES[:3]])
    result = run_nmt("score", "--sys", system, "--ref", short)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("error:") and "\n" not in result.stderr.strip()


def test_empty_files_are_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    reference = write(tmp_path / "ref.txt", REFERENCES)
    with pytest.raises(NmtError, match="empty.txt is empty"):
        score_files(empty, [reference])
    with pytest.raises(NmtError, match="empty.txt is empty"):
        score_files(reference, [empty])


def test_unknown_metric_is_an_error():
    assert parse_metrics("BLEU, chrf,bleu") == ["bleu", "chrf"]
    with pytest.raises(NmtError, match="unknown metric meteor"):
        parse_metrics("bleu,meteor")


@pytest.mark.slow
def test_cli_reads_stdin_and_gzip_references(tmp_path):
    reference = tmp_path / "ref.txt.gz"
    with gzip.open(reference, "wt", encoding="utf-8") as handle:
        handle.write("".join(line + "\n" for line in REFERENCES))
    result = run_nmt("score", "--sys", "-", "--ref", reference, stdin="".join(line + "\n" for line in HYPOTHESES))
    assert result.returncode == 0, result.stderr
    expected = sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES])
    assert result.stdout.startswith("BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|")
    assert f"= {expected.score:.2f} " in result.stdout and len(result.stdout.splitlines()) == 1


@pytest.mark.slow
def test_cli_json_output_parses(tmp_path):
    system = write(tmp_path / "hyp.txt", HYPOTHESES)
    first, second = write(tmp_path / "ref1.txt", REFERENCES), write(tmp_path / "ref2.txt", SECOND_REFERENCES)
    result = run_nmt("score", "--sys", system, "--ref", first, "--ref", second, "--metrics", "bleu,chrf,ter", "--json")
    assert result.returncode == 0, result.stderr
    parsed = json.loads(result.stdout)
    assert [entry["name"] for entry in parsed] == ["BLEU", "chrF2", "TER"]
    assert parsed[0]["score"] == pytest.approx(sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES, SECOND_REFERENCES]).score)
    assert all(entry["signature"].startswith("nrefs:2|") for entry in parsed)


def test_text_format_is_one_line_per_metric():
    results = score(HYPOTHESES, [REFERENCES], metrics=["bleu", "ter"])
    lines = format_results(results).splitlines()
    assert len(lines) == 2 and lines[0].startswith("BLEU|") and lines[1].startswith("TER|")


# Chinese has no spaces: 13a sees each sentence as one or two "words", sacreBLEU's zh tokenizer
# splits the characters, so only the latter measures anything.
CHINESE_HYPOTHESES = ["我喜欢吃苹果。", "今天天气很好。", "他们在公园里散步。"]
CHINESE_REFERENCES = ["我喜欢吃苹果和香蕉。", "今天天气不错。", "他们在公园散步。"]


def test_target_language_picks_sacrebleus_tokenizer():
    expected = sacrebleu.corpus_bleu(CHINESE_HYPOTHESES, [CHINESE_REFERENCES], tokenize="zh")
    (chinese,) = score(CHINESE_HYPOTHESES, [CHINESE_REFERENCES], options=MetricOptions(language="zh"))
    (default,) = score(CHINESE_HYPOTHESES, [CHINESE_REFERENCES])
    assert "tok:zh" in chinese.signature and chinese.score == pytest.approx(expected.score)
    assert "tok:13a" in default.signature and chinese.score > default.score + 20
    (forced,) = score(CHINESE_HYPOTHESES, [CHINESE_REFERENCES], options=MetricOptions(tokenize="13a", language="zh"))
    assert forced.score == pytest.approx(default.score)  # an explicit --tokenize wins over the language
    (char,) = score(HYPOTHESES, [REFERENCES], options=MetricOptions(tokenize="char", lowercase=True))
    assert "tok:char" in char.signature and "case:lc" in char.signature
    with pytest.raises(NmtError, match="unknown BLEU tokenizer 'moses'; choose from auto, none, zh, 13a"):
        score(HYPOTHESES, [REFERENCES], options=MetricOptions(tokenize="moses"))


def test_reference_suffix_gives_the_language():
    assert [language_of(name) for name in ("test.zh", "news.ja.gz", "ref.zh.txt", "ref.txt.gz", "ref", "a.b.json")] \
        == ["zh", "ja", "zh", None, None, None]


def test_cli_tokenize_language_and_signature(tmp_path):
    system = write(tmp_path / "hyp.txt", CHINESE_HYPOTHESES)
    reference = write(tmp_path / "test.zh", CHINESE_REFERENCES)
    untagged = write(tmp_path / "reference.txt", CHINESE_REFERENCES)
    expected = sacrebleu.corpus_bleu(CHINESE_HYPOTHESES, [CHINESE_REFERENCES], tokenize="zh")
    for args in (["--ref", reference], ["--ref", untagged, "-l", "zh"], ["--ref", untagged, "--tokenize", "zh"]):
        result = run_nmt("score", "--sys", system, *args)
        assert result.returncode == 0, result.stderr
        assert "|tok:zh|" in result.stdout and f"= {expected.score:.2f} " in result.stdout, args
    result = run_nmt("score", "--sys", system, "--ref", untagged)
    assert "|tok:13a|" in result.stdout
    result = run_nmt("score", "--sys", system, "--ref", reference, "--tokenize", "moses")
    assert result.returncode == 2 and result.stderr.startswith("error: Invalid value for '--tokenize'")
    assert len(result.stderr.strip().splitlines()) == 1


def test_mecab_tokenizers_without_mecab_are_a_one_line_error(tmp_path):
    try:
        import MeCab  # noqa: F401
        pytest.skip("MeCab is installed: ja-mecab works")
    except ImportError:
        pass
    system = write(tmp_path / "hyp.txt", ["今日は良い天気です。"])
    reference = write(tmp_path / "test.ja", ["今日はいい天気です。"])
    result = run_nmt("score", "--sys", system, "--ref", reference)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == ("error: BLEU tokenizer ja-mecab needs extra packages: pip install -e '.[ja]' in "
                                     "nmt's checkout (or choose another --tokenize)")


def test_a_tokenizer_that_cannot_download_its_model_is_an_error(monkeypatch):
    # sacreBLEU's spm/flores tokenizers fetch a sentencepiece model when built: offline, that is a URLError.
    def offline(**options):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(scoring, "BLEU", offline)
    with pytest.raises(NmtError, match="flores200 could not fetch its sentencepiece model "
                                       r"\(Temporary failure in name resolution\)"):
        score(["a"], [["a"]], options=MetricOptions(tokenize="flores200"))
