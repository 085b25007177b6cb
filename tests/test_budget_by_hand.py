"""The server's memory estimate of a batch of beam search (nmt/serving/budget.py): its figures for
small models written out by hand, and the peak that a search really allocates under it."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nmt.backends.torch_backend import TORCH
from nmt.data.vocabulary import EOS_ID, PAD_ID
from nmt.generation.constraints import BatchControls, SentenceControls
from nmt.generation.ensemble import Ensemble
from nmt.generation.options import SearchOptions
from nmt.generation.search import beam_search
from nmt.models.registry import build_model, get_arch, resolve_config
from nmt.serving.budget import NO_CONTROLS, ControlShape, SearchMemory


def tiny_model(vocab: int, seed: int = 0, **shape) -> torch.nn.Module:
    torch.manual_seed(seed)
    arch = get_arch("transformer_tiny")
    return build_model(arch.model_name, resolve_config(arch.config, {"dropout": 0.0, **shape}), vocab, vocab,
                       PAD_ID).eval()


SMALL = {"d_model": 32, "ffn_dim": 64, "heads": 4, "decoder_layers": 2}


def test_a_row_holds_bos_and_its_output_in_its_layers_cache_and_the_spare():
    """Per row (one beam) on a CPU in fp32: each layer's keys and values and the spare's for every
    position (BOS, and every token but the last; search reserves the room), 104 bytes a position for
    its tokens and scores, 5 vocabulary-wide fp32 tensors, one step's activations and attention scores."""
    memory = SearchMemory(tiny_model(50, **SMALL), "fp32", "cpu")
    # 16 output tokens: 17 positions
    assert memory.row(16) == (2 + 1) * 17 * 2 * 32 * 4 + 17 * 104 + 5 * 50 * 4 + (10 * 32 + 2 * 64 + 4 * 17) * 4
    assert memory.row(16) == 17_888
    assert memory.row(15) == 17_000  # one position less: 768 + 104 + 16 bytes


def test_a_sentence_holds_its_encoder_output_and_its_beams_cross_attention_scores():
    """Per sentence, padded to the batch's longest source: every layer's
    cross-attention keys and values (twice: copied when sentences leave), one encoder layer's
    activations and attention scores while encoding, and beam x heads cross-attention scores."""
    memory = SearchMemory(tiny_model(50, **SMALL), "fp32", "cpu")
    kept = 2 * (2 * 2 * 4) * 32 * 10
    encoding = (6 * 32 + 64 + 4 * 10) * 10 * 4
    assert memory.sentence(10, 4) == kept + 4 * 4 * 4 * 10 + encoding == 22_720
    assert memory.sentence(10, 5) - memory.sentence(10, 4) == 4 * 4 * 10  # one more beam: its heads' scores


def test_a_sentences_controls_count_their_ids_and_each_steps_work_on_them():
    """Per sentence, padded to its batch's largest controls (8-byte ids): 2 bans of 3 pieces kept (the
    phrases, their contexts and last pieces' columns: 3 ids a piece), and each step every beam row
    compared with every ban (an id and 2 booleans a piece), twice for the temporaries; nothing without
    controls."""
    memory = SearchMemory(tiny_model(50, **SMALL), "fp32", "cpu")
    assert memory.sentence_terms(10, 4)["controls"] == 0
    bans = ControlShape(bans=2, ban_pieces=3)
    assert memory.sentence(10, 4, bans) - memory.sentence(10, 4) == 3 * 2 * 3 * 8 + 2 * 4 * 2 * 3 * (8 + 2) == 624
    assert memory.batch([16, 15], 4, 10, bans) == 184_992 + 2 * 624


def test_a_batch_counts_each_sentences_rows_to_its_own_longest_output():
    memory = SearchMemory(tiny_model(50, **SMALL), "fp32", "cpu")
    assert memory.batch([16, 15], 4, 10) == 4 * 17_888 + 4 * 17_000 + 2 * 22_720 == 184_992


def test_an_ensemble_holds_every_models_caches_and_logits():
    small, other = tiny_model(50, **SMALL), tiny_model(50, seed=1, d_model=16, ffn_dim=48, heads=2, decoder_layers=1)
    memory = SearchMemory(Ensemble([small, other]), "fp32", "cpu")
    # 10 tokens, 11 positions: 7 vocabulary-wide tensors for two models
    assert memory.row(10) == 11 * 104 + (2 * 2 + 3) * 50 * 4 + \
        (2 + 1) * 11 * 2 * 32 * 4 + (10 * 32 + 2 * 64 + 4 * 11) * 4 + \
        (1 + 1) * 11 * 2 * 16 * 4 + (10 * 16 + 2 * 48 + 2 * 11) * 4
    assert memory.sentence(5, 2) == \
        2 * (2 * 2 * 4) * 32 * 5 + 2 * 4 * 4 * 5 + (6 * 32 + 64 + 4 * 5) * 5 * 4 + \
        2 * (2 * 1 * 4) * 16 * 5 + 2 * 2 * 4 * 5 + (6 * 16 + 48 + 2 * 5) * 5 * 4


class PeakMemory(TorchDispatchMode):
    """The bytes that torch's operations allocate while it is on: now and at most. A tensor's storage
    counts from the operation that makes it until the last tensor on it (views included) is gone."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, list[int]] = {}  # address -> [bytes, tensors on it]
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
            if address in self.storages:
                self.storages[address][1] += 1
            elif address in given or storage.nbytes() == 0:  # in place, or a view of something older
                continue
            else:
                self.storages[address] = [storage.nbytes(), 1]
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
            weakref.finalize(tensor, self.release, address)
        return out

    def release(self, address: int) -> None:
        entry = self.storages[address]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.storages[address]


def searched_batch(search_path) -> tuple[torch.nn.Module, torch.Tensor]:
    """A tiny model on ``search_path``'s backend and 4 sources of 12 tokens from a vocabulary of 1,000."""
    model = tiny_model(1000)
    model.backend = search_path
    source = torch.randint(4, 1000, (4, 12), generator=torch.Generator().manual_seed(0))
    source[:, -1] = EOS_ID
    return model, source


def test_the_tensors_a_search_allocates_stay_within_the_estimate(search_path):
    """Every beam of 4 sentences searches its 16 steps (min_len = max length): the peak of the tensors
    the search allocates is below the estimate, and within a factor 4 of it (the estimate counts
    every number as fp32 and every buffer at its largest)."""
    model, source = searched_batch(search_path)
    sentences, beam, steps = source.size(0), 4, 16
    estimate = SearchMemory(model, "fp32", "cpu").batch([steps] * sentences, beam, source.size(1))
    options = SearchOptions(beam=beam, nbest=beam, max_len_a=0, max_len_b=steps, min_len=steps, stop="exact")
    with torch.inference_mode(), PeakMemory() as allocated:
        found = beam_search(model, source, options)
    assert [len(h.tokens) for hyps in found for h in hyps] == [steps + 1] * sentences * beam
    assert allocated.peak <= estimate
    if search_path is TORCH:  # the cache copied at each reorder; nmt's C kernels' may reuse a finished one's buffers
        assert estimate < 4 * allocated.peak


def test_a_search_with_controls_stays_within_the_estimate_that_counts_them(search_path):
    """The same with every sentence's controls at the server's caps (8 constraints and 64 bans of 16
    pieces): the peak of the tensors the search allocates is below the estimate for that ControlShape,
    and above the estimate without the controls' term."""
    model, source = searched_batch(search_path)
    sentences, beam, steps = source.size(0), 4, 16
    controls = [SentenceControls(prefix=[10 + s, 11], constraints=[list(range(100 + 16 * c, 116 + 16 * c))
                                                                   for c in range(8)],
                                 bans=[list(range(300 + b, 316 + b)) for b in range(64)]) for s in range(sentences)]
    shape = ControlShape.of(controls)
    memory = SearchMemory(model, "fp32", "cpu")
    estimate = memory.batch([steps] * sentences, beam, source.size(1), shape)
    options = SearchOptions(beam=beam, nbest=1, max_len_a=0, max_len_b=steps, min_len=steps, stop="exact")
    with torch.inference_mode(), PeakMemory() as allocated:
        found = beam_search(model, source, options, None, BatchControls.create(controls, torch.device("cpu")))
    assert [h[0].tokens[:2] for h in found] == [[10 + s, 11] for s in range(sentences)]  # the prefixes held
    assert memory.batch([steps] * sentences, beam, source.size(1), NO_CONTROLS) < allocated.peak <= estimate
