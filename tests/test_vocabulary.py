"""Vocabulary: fixed special ids, encode/decode/normalize agreement, save/load, and clear training errors."""

from __future__ import annotations

import io
import random

import pytest
import sentencepiece as spm

from nmt.data.vocabulary import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Vocabulary
from nmt.errors import NmtError

WORDS = "a the man woman dog cat runs sits in on red blue green big small house street park ball water tree " \
        "ein der mann frau hund läuft sitzt im auf rot blau grün groß klein haus straße baum".split()


def sentences(count: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))).capitalize() + "." for _ in range(count)]


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary.train(sentences(), vocab_size=120)


def test_special_ids_are_fixed(vocab):
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    processor = vocab.processor
    assert (processor.pad_id(), processor.unk_id(), processor.bos_id(), processor.eos_id()) == (0, 1, 2, 3)
    assert len(vocab) == 120


def test_unigram_model_type():
    unigram = Vocabulary.train(sentences(), vocab_size=120, model_type="unigram")
    assert len(unigram) == 120 and unigram.processor.eos_id() == EOS_ID


def test_decode_of_encode_is_normalize_even_with_unknown_characters(vocab):
    for text in ["The dog runs in the park.", "  Der   hund läuft. ", "A ñandú sits on the ball ☃."]:
        ids = vocab.encode(text)
        assert vocab.decode(ids) == vocab.normalize(text)
    assert UNK_ID in vocab.encode("A ñandú.")
    assert "⁇" in vocab.normalize("A ñandú.")


def test_decode_drops_pad_bos_eos(vocab):
    ids = vocab.encode("The dog runs.")
    assert vocab.decode([BOS_ID, *ids, EOS_ID, PAD_ID, PAD_ID]) == vocab.decode(ids) == "The dog runs."


def test_encode_batch_matches_encode_with_threads(vocab):
    texts = sentences(50, seed=3)
    assert vocab.encode_batch(texts, num_threads=2) == [vocab.encode(t) for t in texts]


def test_training_is_deterministic():
    assert Vocabulary.train(sentences(), 120) == Vocabulary.train(sentences(), 120)
    assert Vocabulary.train(sentences(), 120) != Vocabulary.train(sentences(), 110)


def test_save_load_round_trip(vocab, tmp_path):
    vocab.save(tmp_path / "spm.model")
    loaded = Vocabulary.load(tmp_path / "spm.model")
    assert loaded == vocab and loaded.sha256 == vocab.sha256 and len(vocab.sha256) == 64
    assert loaded.encode("The big house.") == vocab.encode("The big house.")
    assert vocab.piece(EOS_ID) == "</s>"


def test_load_errors(tmp_path):
    with pytest.raises(NmtError, match="cannot read sentencepiece model .*missing.model"):
        Vocabulary.load(tmp_path / "missing.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(NmtError,
                       match=r"junk\.model: not a valid sentencepiece model \(its bytes do not parse as one\)$"):
        Vocabulary.load(tmp_path / "junk.model")


def test_a_model_with_other_special_ids_is_refused():
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences()), model_writer=proto, vocab_size=80,
                                   minloglevel=2)  # sentencepiece's defaults: unk=0 bos=1 eos=2, no pad
    with pytest.raises(NmtError, match="special ids .* nmt needs"):
        Vocabulary(proto.getvalue())


@pytest.mark.parametrize("size, message", [
    (5000, r"^--vocab-size 5000 is too large for this corpus: at most \d+ is possible$"),
    (12, r"^--vocab-size 12 is too small: the characters of this corpus and the special tokens need \d+ "),
])
def test_impossible_vocab_sizes_are_one_clear_line(size, message):
    with pytest.raises(NmtError, match=message) as error:
        Vocabulary.train(sentences(), vocab_size=size)
    assert "\n" not in str(error.value) and ".cc(" not in str(error.value)


def test_no_training_text():
    with pytest.raises(NmtError, match="no text to train sentencepiece on"):
        Vocabulary.train([], vocab_size=100)
