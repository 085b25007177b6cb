import pytest

from nmt.demo_data import TEMPLATES, english_number, german_number, sample_numbers, write_demo_corpus
from nmt.errors import NmtError
from nmt.files import read_lines

# Checked by hand against German orthography: numbers below a million are one word, "eins"
# alone or at the end, "ein" inside (einundzwanzig, hunderteintausend), sechzehn/siebzehn/
# sechzig/siebzig drop letters, dreißig has ß.
GERMAN = {
    0: "null", 1: "eins", 2: "zwei", 6: "sechs", 7: "sieben", 11: "elf", 12: "zwölf", 13: "dreizehn",
    16: "sechzehn", 17: "siebzehn", 20: "zwanzig", 21: "einundzwanzig", 30: "dreißig", 31: "einunddreißig",
    36: "sechsunddreißig", 60: "sechzig", 67: "siebenundsechzig", 70: "siebzig", 77: "siebenundsiebzig",
    99: "neunundneunzig", 100: "hundert", 101: "hunderteins", 111: "hundertelf", 121: "hunderteinundzwanzig",
    200: "zweihundert", 716: "siebenhundertsechzehn", 1000: "tausend", 1001: "tausendeins",
    1100: "tausendeinhundert", 1999: "tausendneunhundertneunundneunzig", 2024: "zweitausendvierundzwanzig",
    11000: "elftausend", 17017: "siebzehntausendsiebzehn", 21000: "einundzwanzigtausend",
    100000: "hunderttausend", 100001: "hunderttausendeins", 101000: "hunderteintausend",
    123456: "hundertdreiundzwanzigtausendvierhundertsechsundfünfzig", 300030: "dreihunderttausenddreißig",
    999999: "neunhundertneunundneunzigtausendneunhundertneunundneunzig",
}
ENGLISH = {
    0: "zero", 1: "one", 16: "sixteen", 21: "twenty-one", 30: "thirty", 101: "one hundred one",
    1000: "one thousand", 1999: "one thousand nine hundred ninety-nine", 100000: "one hundred thousand",
    123456: "one hundred twenty-three thousand four hundred fifty-six",
    999999: "nine hundred ninety-nine thousand nine hundred ninety-nine",
}


@pytest.mark.parametrize("number, word", GERMAN.items())
def test_german_number_words(number, word):
    assert german_number(number) == word


@pytest.mark.parametrize("number, words", ENGLISH.items())
def test_english_number_words(number, words):
    assert english_number(number) == words


def test_out_of_range_numbers_are_refused():
    with pytest.raises(NmtError):
        german_number(1_000_000)
    with pytest.raises(NmtError):
        english_number(-1)


def test_sampled_numbers_are_distinct_and_cover_all_lengths():
    numbers = sample_numbers(3000, seed=5)
    assert len(set(numbers)) == 3000 and all(0 <= n <= 999_999 for n in numbers)
    lengths = {len(str(n)) for n in numbers}
    assert lengths == {1, 2, 3, 4, 5, 6}
    assert set(range(10)) <= set(numbers)  # the short numbers are used up, not skipped
    assert sorted(sample_numbers(50, seed=1, max_number=49)) == list(range(50))
    with pytest.raises(NmtError, match="distinct"):
        sample_numbers(51, seed=1, max_number=49)


def read_split(paths, split):
    return list(zip(read_lines(paths[f"{split}.en"]), read_lines(paths[f"{split}.de"])))


def number_of(english_line: str) -> str:
    """The number words of a sentence (what is left after removing its template's words)."""
    for english, _ in TEMPLATES:
        prefix, _, suffix = english.partition("{n}")
        if english_line.startswith(prefix) and english_line.endswith(suffix) and (prefix or suffix):
            return english_line[len(prefix): len(english_line) - len(suffix)]
    return english_line


def test_corpus_splits_are_disjoint_deterministic_and_aligned(tmp_path):
    paths = write_demo_corpus(tmp_path / "a", train_size=400, valid_size=50, test_size=60, seed=7)
    again = write_demo_corpus(tmp_path / "b", train_size=400, valid_size=50, test_size=60, seed=7)
    other = write_demo_corpus(tmp_path / "c", train_size=400, valid_size=50, test_size=60, seed=8)
    splits = {split: read_split(paths, split) for split in ("train", "valid", "test")}
    assert {split: len(pairs) for split, pairs in splits.items()} == {"train": 400, "valid": 50, "test": 60}
    for name in ("train.en", "train.de", "test.en", "test.de"):
        assert paths[name].read_bytes() == again[name].read_bytes()
    assert paths["train.de"].read_bytes() != other["train.de"].read_bytes()
    assert paths["test"] == tmp_path / "a" / "test" and paths["test.en"] == tmp_path / "a" / "test.en"

    numbers = {split: {number_of(english) for english, _ in pairs} for split, pairs in splits.items()}
    assert len(numbers["train"]) == 400  # one distinct number per sentence
    assert not numbers["train"] & numbers["valid"] and not numbers["train"] & numbers["test"]
    assert not numbers["valid"] & numbers["test"]

    drawn = sample_numbers(510, seed=7)  # the corpus draws its numbers the same way, train first
    for (english, german), number in zip(splits["test"], drawn[450:]):
        assert number_of(english) == english_number(number)
        assert german_number(number) in german.rstrip(".?").split()
    templates_used = {english.replace(number_of(english), "{n}") for english, _ in splits["train"]}
    assert len(templates_used) == len(TEMPLATES)


def test_bad_sizes_are_refused(tmp_path):
    with pytest.raises(NmtError, match="test_size"):
        write_demo_corpus(tmp_path, train_size=10, valid_size=2, test_size=0)
