"""Decoding's two backends (nmt/backends): the same search through PyTorch's operations and through
nmt's C kernels gives the same translations in fp32, whatever it is asked for."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_data_dir, numbers_pairs

from nmt.backends.cpu_backend import CpuKernelsBackend
from nmt.backends.kernel_build import built_kernels
from nmt.backends.torch_backend import TORCH
from nmt.checkpoint.format import model_state, save_checkpoint
from nmt.data.dataset import DataDir
from nmt.data.shortlist import learn_shortlist
from nmt.data.vocabulary import PAD_ID
from nmt.generation.constraints import SentenceControls
from nmt.generation.inference import TranslationRequest, prepare_model, translate_ids
from nmt.generation.options import BatchingOptions, SearchOptions
from nmt.models.registry import build_model, get_arch, resolve_config

pytestmark = pytest.mark.skipif(built_kernels()[0] is None, reason="nmt's CPU kernels could not be built here")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    pairs = numbers_pairs(260, seed=5)
    return make_data_dir(tmp_path_factory.mktemp("backends-data"), {"train": pairs[:230], "test": pairs[230:]})


@pytest.fixture(scope="module")
def checkpoints(data_dir, tmp_path_factory) -> list[str]:
    """Two untrained tiny models with peaky distributions (no near-ties) and a shortlist."""
    data = DataDir.open(data_dir)
    vocabs, train = data.vocabularies(), data.split("train")
    vocabs.shortlist = learn_shortlist((train.source.tokens, train.source.offsets),
                                       (train.target.tokens, train.target.offsets), len(vocabs.source),
                                       len(vocabs.target), joint=True, per_piece=4, frequent=4)
    arch = get_arch("transformer_tiny")
    config = resolve_config(arch.config, {"d_model": 32, "ffn_dim": 64})
    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = build_model(arch.model_name, config, len(vocabs.source), len(vocabs.target), PAD_ID)
        with torch.no_grad():
            model.tgt_embed.weight.mul_(4.0)
        path = tmp_path_factory.mktemp("backends-ckpt") / f"model{seed}.pt"
        save_checkpoint(path, model_state(model, "transformer_tiny", config, vocabs))
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def sources(data_dir) -> list[np.ndarray]:
    split = DataDir.open(data_dir).split("test")
    return [split.source[i] for i in range(len(split))]


SEARCHES = {
    "beam, exact": {"beam": 4, "nbest": 3, "stop": "exact", "shortlist": "none"},
    "beam, finished": {"beam": 4, "stop": "finished", "shortlist": "none"},
    "greedy": {"beam": 1, "shortlist": "none"},
    "no repeated bigrams, fairseq's penalty": {"beam": 3, "no_repeat_ngram_size": 2, "lenpen_style": "fairseq",
                                               "shortlist": "none"},
    "shortlist": {"beam": 4, "nbest": 2},
    "controls": {"beam": 4, "nbest": 2, "shortlist": "none"},
    "controls, shortlist": {"beam": 4},
}


@pytest.mark.parametrize("search, ensemble", [(search, False) for search in SEARCHES] +
                         [("beam, exact", True), ("controls, shortlist", True)])
def test_both_backends_translate_alike_in_fp32(checkpoints, sources, search, ensemble):
    paths = checkpoints if ensemble else checkpoints[:1]
    controls = [[SentenceControls(prefix=[9]), SentenceControls(constraints=[[7, 8]]), SentenceControls(bans=[[6]]),
                 None][i % 4] for i in range(len(sources))] if "controls" in search else None
    found = {}
    for backend in ("auto", "torch"):
        model, vocabs = prepare_model(paths, torch.device("cpu"), backend=backend)
        assert isinstance(model.backend, CpuKernelsBackend) if backend == "auto" else model.backend is TORCH
        request = TranslationRequest(SearchOptions(max_len_b=12, **SEARCHES[search]),
                                     BatchingOptions(batch_size=7, max_tokens=None), controls=controls,
                                     shortlist=vocabs.shortlist)
        found[backend] = translate_ids(model, sources, request)
    assert [[h.tokens for h in hyps] for hyps in found["auto"]] == [[h.tokens for h in hyps] for hyps in found["torch"]]
    scores = [[(h.score, *h.positional_scores) for h in hyps] for hyps in found["auto"]]
    expected = [[(h.score, *h.positional_scores) for h in hyps] for hyps in found["torch"]]
    for ours, theirs in zip(scores, expected):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=1e-4)
