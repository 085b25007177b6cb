"""The vocabulary shortlist: learned from a corpus, carried by data directories and checkpoints, and
decoding over each sentence's candidates only (nmt/data/shortlist.py, nmt/generation/candidates.py)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from conftest import make_data_dir, needs_ct2, numbers_pairs, tiny_config

from nmt import Translator
from nmt.backends.cpu_backend import CpuKernelsBackend, Int8Columns
from nmt.backends.kernel_build import built_kernels
from nmt.backends.torch_backend import TorchBackend
from nmt.checkpoint.averaging import average_checkpoints
from nmt.checkpoint.format import load_checkpoint, model_state, save_checkpoint
from nmt.data.dataset import DataDir
from nmt.data.preprocess import PreprocessOptions, preprocess
from nmt.data.shortlist import Shortlist, learn_shortlist
from nmt.data.vocabulary import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Vocabularies
from nmt.errors import NmtError
from nmt.export.ctranslate2 import ExportOptions, export_ctranslate2
from nmt.generation.candidates import batch_candidates
from nmt.generation.constraints import SentenceControls
from nmt.generation.generate import log_shortlist
from nmt.generation.inference import TranslationRequest, prepare_model, translate_ids, uses_shortlist
from nmt.generation.options import BatchingOptions, GenerateOptions, SearchOptions
from nmt.models.registry import build_model, get_arch, resolve_config
from nmt.options import build
from nmt.training.trainer import train


def corpus(pairs: list[tuple[list[int], list[int]]]) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Both sides of token-id sentence pairs as (flat tokens, offsets), each sentence ending in EOS."""
    sides = []
    for side in (0, 1):
        sentences = [pair[side] + [EOS_ID] for pair in pairs]
        offsets = np.concatenate([[0], np.cumsum([len(s) for s in sentences])])
        sides.append((np.concatenate(sentences).astype(np.uint16), offsets))
    return tuple(sides)


def test_model1_ranks_a_pieces_translation_above_the_words_it_merely_meets():
    # Source 10 always meets targets 35, 30 and 21, but 30 also comes with other source pieces (like
    # "the") and 21 with 11: model 1's EM explains them by those, so 10's likeliest translation is
    # 35. Counting co-occurrences (the first iteration alone) ties the three.
    pairs = [([10, 11], [35, 30, 21])] * 3 + [([12], [30, 22])] * 5 + [([13], [30, 23])] * 5 + [([11], [21])] * 3
    source, target = corpus(pairs)
    learned = learn_shortlist(source, target, 40, 40, joint=False, per_piece=3, frequent=0)
    assert learned.translations[10].tolist() == [35, 30, 21]
    counted = learn_shortlist(source, target, 40, 40, joint=False, per_piece=3, frequent=0, iterations=1)
    assert counted.translations[10].tolist() == [21, 30, 35]  # a tie, in id order


def test_the_frequent_pieces_are_everyones_and_the_rest_is_padded():
    pairs = [([10, 11], [35, 30, 21])] * 3 + [([12], [30, 22])] * 5 + [([13], [30, 23])] * 5 + [([11], [21])] * 3
    source, target = corpus(pairs)
    shortlist = learn_shortlist(source, target, 40, 40, joint=False, per_piece=3, frequent=1)
    assert shortlist.frequent.tolist() == [30]  # the most frequent target piece
    assert 30 not in shortlist.translations  # a candidate of every sentence: no slot of its own
    assert shortlist.translations[12].tolist() == [22, 0, 0]  # padded with PAD
    assert shortlist.translations[14].tolist() == [0, 0, 0]  # never seen: nothing of its own


def test_a_joint_vocabulary_lets_every_piece_be_copied():
    pairs = [([10], [20, 21])] * 4
    source, target = corpus(pairs)
    joint = learn_shortlist(source, target, 40, 40, joint=True, per_piece=2, frequent=0)
    assert set(joint.translations[10]) == {10, 20} or set(joint.translations[10]) == {10, 21}
    assert joint.translations[33].tolist() == [33, 0]  # unseen in training, still itself
    separate = learn_shortlist(source, target, 40, 40, joint=False, per_piece=2, frequent=0)
    assert 10 not in separate.translations[10]


def test_a_piece_already_among_its_own_translations_keeps_every_other_one():
    """With a joint vocabulary each piece is its own candidate: added in a free slot or, in a full
    row, over the least likely translation; a piece that already translates to itself loses none."""
    pairs = [([10], [10, 20])] * 4 + [([11], [21, 22, 23])] * 4
    source, target = corpus(pairs)
    joint = learn_shortlist(source, target, 40, 40, joint=True, per_piece=2, frequent=0)
    assert sorted(joint.translations[10].tolist()) == [10, 20]  # full, itself included: as learned
    assert 11 in joint.translations[11] and len(set(joint.translations[11].tolist()) - {11}) == 1
    separate = learn_shortlist(source, target, 40, 40, joint=False, per_piece=2, frequent=0)
    assert sorted(separate.translations[10].tolist()) == [10, 20]
    assert joint.translations[11][0] == separate.translations[11][0]  # the likeliest stays; the other gave way


def test_a_large_corpus_is_learned_from_a_seeded_sample():
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(4, 30, 5).tolist(), rng.integers(4, 30, 6).tolist()) for _ in range(200)]
    source, target = corpus(pairs)
    whole = learn_shortlist(source, target, 30, 30, joint=False, per_piece=3, frequent=2)
    sampled, again = (learn_shortlist(source, target, 30, 30, joint=False, per_piece=3, frequent=2, max_links=600)
                      for _ in range(2))
    assert np.array_equal(sampled.translations, again.translations)
    assert not np.array_equal(sampled.translations, whole.translations)


def test_bytes_round_trip_and_mismatched_sizes_are_refused():
    shortlist = Shortlist(np.arange(12, dtype=np.uint16).reshape(6, 2), np.asarray([5, 4], dtype=np.uint16), 12)
    again = Shortlist.from_bytes(shortlist.to_bytes(), 6, 12)
    assert np.array_equal(again.translations, shortlist.translations)
    assert np.array_equal(again.frequent, shortlist.frequent)
    with pytest.raises(NmtError, match="6 source pieces, the source vocabulary 7"):
        Shortlist.from_bytes(shortlist.to_bytes(), 7, 12)
    with pytest.raises(NmtError, match="not ids of the 11-piece target vocabulary"):
        Shortlist.from_bytes(shortlist.to_bytes(), 6, 11)
    with pytest.raises(NmtError, match="not readable"):
        Shortlist.from_bytes(b"not a shortlist", 6, 12)


def test_batch_candidates_keep_each_sentence_to_its_own():
    translations = np.zeros((10, 2), dtype=np.uint16)
    translations[5], translations[6] = (7, 8), (9, 0)
    shortlist = Shortlist(translations, np.asarray([4], dtype=np.uint16), 10)
    found = batch_candidates(shortlist, [np.asarray([5, EOS_ID]), np.asarray([6, EOS_ID])], torch.device("cpu"),
                             required=[(), [5]])
    # ascending, specials first; the second requires 5 (a prefix, say)
    specials = [PAD_ID, UNK_ID, BOS_ID, EOS_ID]
    assert found.columns.tolist() == [specials + [4, 7, 8], specials + [4, 5, 9]]
    assert found.padding is None


def test_a_sentence_with_fewer_candidates_repeats_its_last_and_bans_the_repeats():
    translations = np.zeros((10, 2), dtype=np.uint16)
    translations[5], translations[6] = (7, 8), (9, 0)
    shortlist = Shortlist(translations, np.asarray([4], dtype=np.uint16), 10)
    found = batch_candidates(shortlist, [np.asarray([6, EOS_ID]), np.asarray([5, 6, EOS_ID])], torch.device("cpu"))
    assert found.columns.tolist() == [[0, 1, 2, 3, 4, 9, 9, 9], [0, 1, 2, 3, 4, 7, 8, 9]]
    inf = float("inf")
    assert found.padding.tolist() == [[0, 0, 0, 0, 0, 0, -inf, -inf], [0] * 8]


def test_preprocess_learns_it_and_training_carries_it_into_checkpoints(tmp_path):
    pairs = numbers_pairs(200, seed=4)
    for lang, side in (("en", 0), ("de", 1)):
        (tmp_path / f"train.{lang}").write_text("".join(pair[side] + "\n" for pair in pairs), encoding="utf-8")
    data = preprocess(PreprocessOptions("en", "de", str(tmp_path / "bin"), trainpref=str(tmp_path / "train"),
                                        vocab_size=120, byte_fallback=False), show_progress=False)
    assert data.meta.shortlist_file == "shortlist.npz"
    shortlist = data.vocabularies().shortlist
    split = data.split("train")
    learned = learn_shortlist((split.source.tokens, split.source.offsets), (split.target.tokens, split.target.offsets),
                              120, 120, joint=True)
    assert np.array_equal(shortlist.translations, learned.translations)
    assert np.array_equal(shortlist.frequent, learned.frequent)
    train(tiny_config(data.path, tmp_path / "run", max_update=1))
    carried = load_checkpoint(tmp_path / "run" / "checkpoint_last.pt")["vocab"]["shortlist"]
    assert carried == shortlist.to_bytes()


# -- decoding -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    pairs = numbers_pairs(260, seed=3)
    return make_data_dir(tmp_path_factory.mktemp("shortlist-data"), {"train": pairs[:240], "test": pairs[240:]})


@pytest.fixture(scope="module")
def vocabs(data_dir) -> Vocabularies:
    data = DataDir.open(data_dir)
    vocabs = data.vocabularies()
    train = data.split("train")
    vocabs.shortlist = learn_shortlist((train.source.tokens, train.source.offsets),
                                       (train.target.tokens, train.target.offsets), len(vocabs.source),
                                       len(vocabs.target), joint=True, per_piece=4, frequent=4)
    return vocabs


def tiny_checkpoint(directory, vocabs: Vocabularies):
    """An untrained, deterministic tiny model with peaky distributions (no near-ties)."""
    torch.manual_seed(0)
    arch = get_arch("transformer_tiny")
    config = resolve_config(arch.config, {"d_model": 32, "ffn_dim": 64})
    model = build_model(arch.model_name, config, len(vocabs.source), len(vocabs.target), PAD_ID)
    with torch.no_grad():
        model.tgt_embed.weight.mul_(4.0)
    path = directory / "model.pt"
    save_checkpoint(path, model_state(model, "transformer_tiny", config, vocabs))
    return path


@pytest.fixture(scope="module")
def checkpoint(vocabs, tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("shortlist-ckpt"), vocabs)


@pytest.fixture(scope="module")
def sources(data_dir) -> list[np.ndarray]:
    split = DataDir.open(data_dir).split("test")
    return [split.source[i] for i in range(len(split))]


def whole_vocabulary(size: int) -> Shortlist:
    return Shortlist(np.tile(np.arange(size, dtype=np.uint16), (size, 1)), np.arange(size, dtype=np.uint16), size)


def hypotheses(model, sources, given: Shortlist | None, precision="fp32", **search):
    search = SearchOptions(**{"beam": 3, "nbest": 2, "max_len_b": 8, **search})
    request = TranslationRequest(search, BatchingOptions(max_tokens=None, batch_size=7), precision=precision,
                                 shortlist=given)
    found = translate_ids(model, sources, request)
    return [[(h.tokens, h.score, h.positional_scores) for h in hyps] for hyps in found]


@pytest.mark.parametrize("quantize,precision", [("none", "fp32"), ("int8", "fp32"), ("none", "bf16")])
def test_a_shortlist_of_the_whole_vocabulary_changes_nothing(checkpoint, sources, quantize, precision, monkeypatch):
    """int8 through torch's products here; nmt's C projection quantizes each row on its own (below)."""
    monkeypatch.setattr(CpuKernelsBackend, "column_projection", TorchBackend.column_projection)
    model, vocabs = prepare_model(checkpoint, torch.device("cpu"), quantize)
    everything = whole_vocabulary(len(vocabs.target))
    assert hypotheses(model, sources, everything, precision, no_repeat_ngram_size=2) == \
        hypotheses(model, sources, None, precision, no_repeat_ngram_size=2)


@pytest.mark.skipif(built_kernels()[0] is None or not built_kernels()[0].int8_vnni,
                    reason="needs nmt's CPU kernels built with AVX512-VNNI (else the union's product)")
def test_int8_on_cpu_projects_each_sentences_rows_onto_its_own_columns_in_c(checkpoint, vocabs, sources):
    model, _ = prepare_model(checkpoint, torch.device("cpu"), "int8")
    chosen = sources[:5]
    batch = torch.nn.utils.rnn.pad_sequence([torch.from_numpy(s.astype(np.int64)) for s in chosen],
                                            batch_first=True, padding_value=PAD_ID)
    candidates = batch_candidates(vocabs.shortlist, chosen, torch.device("cpu"))
    assert candidates.padding is not None  # the sentences hold different numbers of candidates
    prefix = torch.tensor([[BOS_ID, 5, 6]] * 10)  # two rows per sentence
    with torch.inference_mode():
        encoded = model.encode(batch, candidates.columns)
        assert isinstance(encoded.output, Int8Columns)
        logits = model.decode(prefix, encoded)
        whole = model.decode(prefix, model.encode(batch))
        states = model.decode(prefix, encoded, features_only=True)
        left = torch.tensor([3, 0])  # the others have left the batch
        kept = model.reorder_encoder_out(encoded, left).output(states.view(5, 2, 3, -1)[left].view(4, 3, -1))
    own = candidates.padding.repeat_interleave(2, dim=0)[:, None, :].expand_as(logits) == 0
    assert torch.equal(logits.isfinite(), own)
    expected = whole.gather(2, candidates.columns.repeat_interleave(2, dim=0)[:, None, :].expand_as(logits))
    assert torch.equal(logits[own], expected[own])  # the same quantization, products and rounding as the whole layer's
    # Each row quantized on its own: its logits do not depend on the batch's other rows.
    assert torch.equal(kept, logits.view(5, 2, 3, -1)[left].view(4, 3, -1))


@pytest.mark.parametrize("quantize,precision", [("none", "fp32"), ("int8", "fp32"), ("none", "bf16")])
def test_each_translation_keeps_to_its_sentences_candidates(checkpoint, sources, quantize, precision):
    model, vocabs = prepare_model(checkpoint, torch.device("cpu"), quantize)
    assert vocabs.shortlist is not None  # the checkpoint carries it
    with_shortlist = hypotheses(model, sources, vocabs.shortlist, precision)
    without = hypotheses(model, sources, None, precision)
    assert with_shortlist != without  # the random model likes pieces outside the candidates
    for source, hyps in zip(sources, with_shortlist):
        allowed = set(vocabs.shortlist.candidates([source])[0].nonzero()[0].tolist()) | {EOS_ID}
        assert all(set(tokens) <= allowed for tokens, _, _ in hyps)
        assert all(np.isfinite(score) for _, score, _ in hyps)


def test_no_repeat_ngrams_are_banned_in_column_space(checkpoint, sources):
    model, vocabs = prepare_model(checkpoint, torch.device("cpu"))
    for hyps in hypotheses(model, sources, vocabs.shortlist, no_repeat_ngram_size=1, max_len_b=12):
        for tokens, _, _ in hyps:
            assert len(set(tokens)) == len(tokens)


def test_with_a_shortlist_translations_do_not_depend_on_the_batch(checkpoint, sources):
    model, vocabs = prepare_model(checkpoint, torch.device("cpu"))
    search = SearchOptions(beam=3, nbest=3, max_len_b=8)

    def run(order, **batching):
        found = translate_ids(model, [sources[i] for i in order],
                              TranslationRequest(search, BatchingOptions(**batching), shortlist=vocabs.shortlist))
        restored = [None] * len(sources)
        for position, index in enumerate(order):
            restored[index] = [h.tokens for h in found[position]]
        return restored

    identity = np.arange(len(sources))
    alone = run(identity, batch_size=1, max_tokens=None)
    assert run(identity, batch_size=20, max_tokens=None) == alone
    assert run(np.random.default_rng(0).permutation(len(sources)), batch_size=6, max_tokens=None, workers=2) == alone


def test_with_a_shortlist_controls_keep_to_each_sentences_columns_whatever_the_batch(checkpoint, sources):
    """Prefixes, constraints and bans looked up in each sentence's own columns, as sentences leave
    the batch at different steps: the same translations batched as one at a time."""
    model, vocabs = prepare_model(checkpoint, torch.device("cpu"))
    search = SearchOptions(beam=3, max_len_b=8)
    controls = [[SentenceControls(prefix=[9]), SentenceControls(constraints=[[7, 8]]),
                 SentenceControls(bans=[[6]]), None][i % 4] for i in range(len(sources))]

    def run(batch_size):
        batching = BatchingOptions(batch_size=batch_size, max_tokens=None)
        found = translate_ids(model, sources,
                              TranslationRequest(search, batching, controls=controls, shortlist=vocabs.shortlist))
        return [hyps[0].tokens for hyps in found]

    batched = run(20)
    assert batched == run(1)
    for tokens, control in zip(batched, controls):
        if control and control.prefix:
            assert tokens[0] == 9
        if control and control.constraints:
            assert any(tokens[i:i + 2] == [7, 8] for i in range(len(tokens)))
        if control and control.bans:
            assert 6 not in tokens


def test_shortlist_none_and_sampling_score_the_whole_vocabulary(checkpoint, sources):
    model, vocabs = prepare_model(checkpoint, torch.device("cpu"))
    without = hypotheses(model, sources, None)
    assert hypotheses(model, sources, vocabs.shortlist, shortlist="none") == without
    sampled = {"sampling": True, "beam": 2, "nbest": 1, "seed": 5}
    assert hypotheses(model, sources, vocabs.shortlist, **sampled) == hypotheses(model, sources, None, **sampled)


def test_auto_uses_the_shortlist_on_the_cpu_only_and_says_so(checkpoint, caplog):
    _, vocabs = prepare_model(checkpoint, torch.device("cpu"))
    search = SearchOptions()
    assert uses_shortlist(search, vocabs.shortlist, "cpu")
    assert not uses_shortlist(search, vocabs.shortlist, "cuda")
    assert not uses_shortlist(SearchOptions(shortlist="none"), vocabs.shortlist, "cpu")
    with caplog.at_level("INFO", logger="nmt"):
        log_shortlist(search, vocabs, torch.device("cuda"), "each sentence scores its own candidates")
        log_shortlist(search, vocabs, torch.device("cpu"), "each sentence scores its own candidates")
    assert [record.getMessage().split(",")[0] for record in caplog.records] == [
        "vocabulary shortlist: not on cuda", "vocabulary shortlist: each sentence scores its own candidates (4 per "
        "source piece"]


def test_a_checkpoint_without_a_shortlist_decodes_as_before(vocabs, sources, tmp_path):
    old_style = Vocabularies(vocabs.source_lang, vocabs.target_lang, vocabs.source, vocabs.target)
    path = tiny_checkpoint(tmp_path, old_style)
    assert "shortlist" not in load_checkpoint(path)["vocab"]
    model, loaded = prepare_model(path, torch.device("cpu"))
    assert loaded.shortlist is None
    assert hypotheses(model, sources, loaded.shortlist) == hypotheses(model, sources, None, shortlist="none")


def test_averaging_keeps_the_shortlist(checkpoint, vocabs, tmp_path):
    averaged = average_checkpoints([checkpoint, tiny_checkpoint(tmp_path, vocabs)])
    assert averaged["vocab"]["shortlist"] == vocabs.shortlist.to_bytes()


def test_an_ensemble_uses_a_shortlist_only_when_its_models_share_it(checkpoint, vocabs, tmp_path):
    other = Vocabularies(vocabs.source_lang, vocabs.target_lang, vocabs.source, vocabs.target,
                         whole_vocabulary(len(vocabs.target)))
    twin = tmp_path / "twin.pt"  # the same model in another file (one file given twice is refused)
    shutil.copy(checkpoint, twin)
    _, same = prepare_model([str(checkpoint), str(twin)], torch.device("cpu"))
    _, different = prepare_model([str(checkpoint), str(tiny_checkpoint(tmp_path, other))], torch.device("cpu"))
    assert same.shortlist is not None and different.shortlist is None


# -- CTranslate2 ----------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def trained_with_shortlist(tiny_data_dir, tmp_path_factory):
    """transformer_tiny after 120 updates on the numbers task, given a small shortlist afterwards."""
    save_dir = tmp_path_factory.mktemp("shortlist-train")
    train(tiny_config(tiny_data_dir, save_dir, max_update=120, valid_subset="none", log_interval=1000))
    checkpoint = load_checkpoint(save_dir / "checkpoint_last.pt")
    train_split, size = DataDir.open(tiny_data_dir).split("train"), len(DataDir.open(tiny_data_dir).vocabulary("en"))
    shortlist = learn_shortlist((train_split.source.tokens, train_split.source.offsets),
                                (train_split.target.tokens, train_split.target.offsets), size, size, joint=True,
                                per_piece=2, frequent=2)
    checkpoint["vocab"]["shortlist"] = shortlist.to_bytes()
    save_checkpoint(save_dir / "with_shortlist.pt", checkpoint)
    return save_dir / "with_shortlist.pt"


@needs_ct2
def test_the_export_writes_a_vocabulary_map_that_ctranslate2_decodes_with(trained_with_shortlist, tmp_path):
    from nmt.generation.ctranslate2_engine import open_translator, translate_ids_ctranslate2

    directory = export_ctranslate2(ExportOptions(str(trained_with_shortlist), str(tmp_path / "model")))
    model, vocabs = prepare_model(trained_with_shortlist, torch.device("cpu"))
    lines = (directory / "vmap.txt").read_text(encoding="utf-8").splitlines()
    piece = vocabs.target.piece
    assert lines[0] == "\t" + " ".join(piece(int(t)) for t in vocabs.shortlist.frequent)
    key, values = lines[4].split("\t")  # after UNK's, BOS's and EOS's lines (PAD has none): the first word piece
    assert key == piece(4) and values.split() == [piece(int(t)) for t in vocabs.shortlist.translations[4] if t]

    sources = [np.asarray(ids + [EOS_ID]) for ids in vocabs.source.encode_batch([s for s, _ in numbers_pairs(40, 12)])]
    translator, ct2_vocabs, max_positions = open_translator(directory, torch.device("cpu"), "default")
    assert ct2_vocabs.shortlist.to_bytes() == vocabs.shortlist.to_bytes()

    def best(engine: str, shortlist: str) -> list[list[int]]:
        options = build(GenerateOptions, {"input": "-", "beam": 1, "lenpen": 0.0, "batch_size": 1, "max_tokens": None,
                                          "shortlist": shortlist})
        if engine == "nmt":
            found = translate_ids(model, sources,
                                  TranslationRequest(options.search, options.batching, shortlist=vocabs.shortlist))
        else:
            found = translate_ids_ctranslate2(translator, ct2_vocabs, sources, options, max_positions=max_positions)
        return [hyps[0].tokens for hyps in found]

    with_map = best("ctranslate2", "auto")
    assert with_map != best("ctranslate2", "none")  # the map is used: two candidates per piece are too few
    assert with_map == best("nmt", "auto")  # one sentence a batch: the same candidates in both engines


# -- the Python API and the server ---------------------------------------------------------------

def test_the_api_and_the_server_use_the_checkpoints_shortlist_by_default(checkpoint, tmp_path_factory):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from test_serve import request, run_server

    lines = [source for source, _ in numbers_pairs(12, seed=9)]
    translator = Translator.from_checkpoint(checkpoint, device="cpu")
    shortlisted, whole = translator.translate(lines), translator.translate(lines, shortlist="none")
    assert shortlisted != whole
    server = run_server(checkpoint, tmp_path_factory)
    address = next(server)
    try:
        assert request(address, "GET", "/info")[1]["vocab"]["shortlist"] is True
        assert request(address, "POST", "/translate", {"text": lines})[1]["translations"] == shortlisted
        assert request(address, "POST", "/translate", {"text": lines, "shortlist": "none"})[1]["translations"] == whole
    finally:
        server.close()
