"""A synthetic EN->DE task that needs no download: numbers written out in words, in sentences.

German writes numbers below a million as one word with the units before the tens
("twenty-one" -> "einundzwanzig"), so the model has to learn reordering, compounding and the
irregular forms (sechzehn, siebzig, dreißig, eins/ein). The numbers sit in a few sentence
templates, some of which move the verb to the end in German. Splits use disjoint numbers, so
the test set measures generalization, not memory.
"""

from __future__ import annotations

import random
from pathlib import Path

from nmt.errors import NmtError
from nmt.files import atomic_write

MAX_NUMBER = 999_999

EN_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
           "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
EN_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]

# "eins" stands alone or ends a number; inside a compound it is "ein" (einundzwanzig, hunderteintausend).
DE_ONES = ["null", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun", "zehn", "elf", "zwölf",
           "dreizehn", "vierzehn", "fünfzehn", "sechzehn", "siebzehn", "achtzehn", "neunzehn"]
DE_TENS = ["", "", "zwanzig", "dreißig", "vierzig", "fünfzig", "sechzig", "siebzig", "achtzig", "neunzig"]

# (English, German) with {n} for the number. In each the number stands alone (not before a noun),
# where German uses the uninflected forms above.
TEMPLATES = [
    ("{n}", "{n}"),
    ("the number {n}", "die Zahl {n}"),
    ("The answer is {n}.", "Die Antwort ist {n}."),
    ("Can you count to {n}?", "Kannst du bis {n} zählen?"),
    ("I counted to {n} yesterday.", "Ich habe gestern bis {n} gezählt."),
    ("Please write {n} on the board.", "Bitte schreib {n} an die Tafel."),
    ("My room number is {n}.", "Meine Zimmernummer ist {n}."),
    ("Turn to page {n}.", "Schlag Seite {n} auf."),
    ("She said {n} twice.", "Sie hat zweimal {n} gesagt."),
]


def _check_range(number: int) -> None:
    if not 0 <= number <= MAX_NUMBER:
        raise NmtError(f"number out of range 0..{MAX_NUMBER}: {number}")


def english_number(number: int) -> str:
    """American style, no "and": 123456 -> one hundred twenty-three thousand four hundred fifty-six."""
    _check_range(number)

    def below_thousand(n: int) -> list[str]:
        words = []
        if n >= 100:
            words += [EN_ONES[n // 100], "hundred"]
            n %= 100
        if n >= 20:
            words.append(EN_TENS[n // 10] + (f"-{EN_ONES[n % 10]}" if n % 10 else ""))
        elif n:
            words.append(EN_ONES[n])
        return words

    if number == 0:
        return EN_ONES[0]
    thousands, rest = divmod(number, 1000)
    words = below_thousand(thousands) + ["thousand"] if thousands else []
    return " ".join(words + below_thousand(rest))


def german_number(number: int) -> str:
    """One word below a million: 123456 -> hundertdreiundzwanzigtausendvierhundertsechsundfünfzig.

    A leading one before hundert/tausend is left out (hundert, tausend, hunderttausend); inside
    the word it is written (tausendeinhundert).
    """
    _check_range(number)

    def below_thousand(n: int, leading: bool, final: bool) -> str:
        """``leading``: nothing precedes (so "hundert", not "einhundert"); ``final``: "eins", not "ein"."""
        hundreds, rest = divmod(n, 100)
        word = ""
        if hundreds:
            word = ("" if hundreds == 1 and leading else "ein" if hundreds == 1 else DE_ONES[hundreds]) + "hundert"
        if rest == 1:
            word += "eins" if final else "ein"
        elif rest < 20:
            word += DE_ONES[rest] if rest else ""
        else:
            units = rest % 10
            word += (("ein" if units == 1 else DE_ONES[units]) + "und" if units else "") + DE_TENS[rest // 10]
        return word

    if number == 0:
        return DE_ONES[0]
    thousands, rest = divmod(number, 1000)
    word = ""
    if thousands:
        word = ("" if thousands == 1 else below_thousand(thousands, leading=True, final=False)) + "tausend"
    if rest:
        word += below_thousand(rest, leading=not thousands, final=True)
    return word


def sample_numbers(count: int, seed: int, max_number: int = MAX_NUMBER) -> list[int]:
    """``count`` distinct numbers in 0..max_number, spread evenly over digit lengths so that
    short numbers (the irregular ones) are not drowned by six-digit ones.

    The few one- and two-digit numbers run out first, so with train taking the first slice they
    all land in train, and valid/test hold longer numbers built from them.
    """
    _check_range(max_number)
    if count > max_number + 1:
        raise NmtError(f"cannot draw {count} distinct numbers from 0..{max_number}")
    rng = random.Random(seed)
    buckets = []  # (low, high) per digit length, clipped to max_number
    for digits in range(1, len(str(max_number)) + 1):
        low, high = (0 if digits == 1 else 10 ** (digits - 1)), min(10 ** digits - 1, max_number)
        buckets.append([low, high, set()])
    chosen: list[int] = []
    while len(chosen) < count:
        bucket = rng.choice(buckets)
        low, high, used = bucket
        number = rng.randint(low, high)
        if number in used:
            continue
        used.add(number)
        chosen.append(number)
        if len(used) == high - low + 1:
            buckets.remove(bucket)
    return chosen


def demo_pairs(numbers: list[int], seed: int) -> list[tuple[str, str]]:
    """One (English, German) sentence pair per number, templates drawn with ``seed``."""
    rng = random.Random(seed)
    pairs = []
    for number in numbers:
        english, german = rng.choice(TEMPLATES)
        pairs.append((english.format(n=english_number(number)), german.format(n=german_number(number))))
    return pairs


def write_demo_corpus(directory: str | Path, train_size: int = 20_000, valid_size: int = 500, test_size: int = 500,
                      seed: int = 1, max_number: int = MAX_NUMBER) -> dict[str, Path]:
    """Write {train,valid,test}.{en,de} into ``directory``; the same seed gives the same files.

    Returns the paths by "split.lang" ("train.en", ...); "train", "valid" and "test" map to the
    file prefixes (directory/train) that preprocess takes.
    """
    sizes = {"train": train_size, "valid": valid_size, "test": test_size}
    for split, size in sizes.items():
        if size < 1:
            raise NmtError(f"{split}_size must be at least 1, got {size}")
    numbers = sample_numbers(sum(sizes.values()), seed, max_number)
    directory = Path(directory)
    paths: dict[str, Path] = {}
    start = 0
    for offset, (split, size) in enumerate(sizes.items()):
        pairs = demo_pairs(numbers[start:start + size], seed=seed * 1000 + offset)
        start += size
        paths[split] = directory / split
        for lang, side in (("en", 0), ("de", 1)):
            path = directory / f"{split}.{lang}"
            with atomic_write(path) as handle:
                handle.writelines(pair[side] + "\n" for pair in pairs)
            paths[f"{split}.{lang}"] = path
    return paths
