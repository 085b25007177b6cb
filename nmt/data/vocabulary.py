"""SentencePiece subword vocabulary with the special-token ids every command shares."""

from __future__ import annotations

import hashlib
import io
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import sentencepiece as spm

from nmt.data.shortlist import Shortlist
from nmt.errors import NmtError
from nmt.files import atomic_write

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


def training_error_message(error: str, vocab_size: int, byte_fallback: bool = False) -> str:
    """One readable line for a sentencepiece trainer error (its raw text names C++ source lines)."""
    message = error.strip().splitlines()[-1] if error.strip() else "unknown error"
    message = re.sub(r"^.*?\] ", "", message)  # drop "INTERNAL: src/trainer_interface.cc(744) [check] "
    if match := re.search(r"Vocabulary size too high .*<= (\d+)", message):
        return f"--vocab-size {vocab_size} is too large for this corpus: at most {match[1]} is possible"
    if match := re.search(r"smaller than required_chars\. \d+ vs (\d+)", message):
        needs = "the characters of this corpus, the special tokens and byte fallback's 256 bytes" if byte_fallback \
            else "the characters of this corpus and the special tokens"
        return (f"--vocab-size {vocab_size} is too small: {needs} need {match[1]} (raise --vocab-size or lower "
                f"--character-coverage{', or --no-byte-fallback' if byte_fallback else ''})")
    if "sentences_.empty()" in error:
        return "no text to train sentencepiece on: the training files are empty"
    return f"sentencepiece training failed: {message}"


class Vocabulary:
    """A trained SentencePiece model, kept as its serialized bytes so checkpoints carry it."""

    def __init__(self, model_proto: bytes):
        self.model_proto = model_proto
        self.processor = spm.SentencePieceProcessor()
        try:
            self.processor.LoadFromSerializedProto(model_proto)
        except Exception as exc:  # sentencepiece raises bare RuntimeError/OSError naming its C++ source (-v shows it)
            raise NmtError("not a valid sentencepiece model (its bytes do not parse as one)") from exc
        expected = {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID}
        actual = {"pad": self.processor.pad_id(), "unk": self.processor.unk_id(),
                  "bos": self.processor.bos_id(), "eos": self.processor.eos_id()}
        if actual != expected:
            raise NmtError(f"sentencepiece model has special ids {actual}; nmt needs {expected} "
                           "(train it with nmt preprocess, or with pad_id=0 unk_id=1 bos_id=2 eos_id=3)")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Vocabulary":
        try:
            with open(path, "rb") as handle:
                return cls(handle.read())
        except NmtError as exc:
            raise NmtError(f"{path}: {exc}") from exc
        except OSError as exc:
            raise NmtError(f"cannot read sentencepiece model {path}: {exc.strerror or exc}") from exc

    def save(self, path: str | os.PathLike) -> None:
        with atomic_write(path, "wb") as handle:
            handle.write(self.model_proto)

    @classmethod
    def train(cls, sentences: Iterable[str], vocab_size: int, model_type: str = "bpe",
              character_coverage: float = 1.0, input_sentence_size: int = 0, seed_sentencepiece_size: int = 1_000_000,
              num_threads: int = 1, byte_fallback: bool = False) -> "Vocabulary":
        """Train on ``sentences``, which may be a stream: with ``input_sentence_size`` > 0 sentencepiece
        keeps a uniform sample of that many (reservoir sampling), never the whole stream.

        ``byte_fallback`` adds the 256 UTF-8 byte pieces, so a character outside the vocabulary is
        spelled in bytes (and decodes back to itself) instead of becoming UNK.
        """
        proto = io.BytesIO()
        failures: list[BaseException] = []  # raised by the stream: sentencepiece would only show their text

        def checked() -> Iterator[str]:
            try:
                yield from sentences
            except BaseException as exc:
                failures.append(exc)
                raise

        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=checked(), model_writer=proto, vocab_size=vocab_size,
                model_type=model_type, character_coverage=character_coverage,
                input_sentence_size=input_sentence_size, shuffle_input_sentence=input_sentence_size > 0,
                seed_sentencepiece_size=seed_sentencepiece_size, num_threads=num_threads, byte_fallback=byte_fallback,
                pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
                max_sentence_length=1 << 16, minloglevel=2,
            )
        except RuntimeError as exc:
            if failures:
                raise failures[0] from None
            raise NmtError(training_error_message(str(exc), vocab_size, byte_fallback)) from exc
        return cls(proto.getvalue())

    def __len__(self) -> int:
        return self.processor.get_piece_size()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and other.model_proto == self.model_proto

    __hash__ = None  # mutable-free but compared by content; not meant as a dict key

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.model_proto).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self.processor.encode(text, out_type=int)

    def encode_batch(self, texts: list[str], num_threads: int = 1, sampling_alpha: float = 0.0) -> list[list[int]]:
        """``sampling_alpha`` > 0 samples a segmentation instead of the best one: BPE-dropout with that
        probability for a bpe model, subword regularization with that smoothing for a unigram one."""
        if sampling_alpha:
            try:
                return self.processor.encode(texts, out_type=int, num_threads=num_threads, enable_sampling=True,
                                             alpha=sampling_alpha, nbest_size=-1)
            except RuntimeError as exc:  # a char or word model: nothing to sample
                raise NmtError(f"this sentencepiece model cannot sample segmentations ({exc}); "
                               "--subword-samples needs a bpe or unigram model") from exc
        return self.processor.encode(texts, out_type=int, num_threads=num_threads)

    def decode(self, ids: Iterable[int]) -> str:
        """Detokenize, dropping pad/bos/eos; UNK stays visible (" ⁇ "), so this matches normalize()."""
        return self.processor.decode([i for i in ids if i not in (PAD_ID, BOS_ID, EOS_ID)])

    def piece(self, token_id: int) -> str:
        return self.processor.id_to_piece(token_id)

    def normalize(self, text: str) -> str:
        """The text as the model sees it (NFKC, whitespace): what decode(encode(text)) gives."""
        return self.processor.decode(self.processor.encode(text, out_type=int))


@dataclass
class Vocabularies:
    """The source and target vocabularies of a language pair (one object twice when joint), and the
    vocabulary shortlist learned with them, if any (not compared: it only speeds decoding up)."""

    source_lang: str
    target_lang: str
    source: Vocabulary
    target: Vocabulary
    shortlist: Shortlist | None = field(default=None, compare=False)

    @property
    def joint(self) -> bool:
        return self.source == self.target

    def to_state(self) -> dict[str, Any]:
        shortlist = {} if self.shortlist is None else {"shortlist": self.shortlist.to_bytes()}
        return {"source_lang": self.source_lang, "target_lang": self.target_lang,
                "source": self.source.model_proto, "target": self.target.model_proto, **shortlist}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Vocabularies":
        """Checkpoints from before shortlists have none."""
        source, target = Vocabulary(state["source"]), Vocabulary(state["target"])
        shortlist = Shortlist.from_bytes(state["shortlist"], len(source), len(target)) if "shortlist" in state else None
        return cls(state["source_lang"], state["target_lang"], source, target, shortlist)
