"""--threads: torch's intra-op threads for generate, serve and train, in all (workers and processes
share them), set before the model is built; a recipe's `threads:` too."""

from __future__ import annotations

import pytest
import torch
from conftest import THREADS, run_cli, tiny_config

from nmt.device import use_threads
from nmt.generation import inference as inference_module
from nmt.training.config import load_train_config


@pytest.mark.parametrize("threads,workers,each", [(3, 1, 3), (4, 2, 2)])
def test_generate_decodes_with_the_threads_given_shared_by_the_workers(untrained_checkpoint, tiny_data_dir,
                                                                       monkeypatch, capsys, threads, workers, each):
    """Two workers of two threads each are threads of this process (a forked worker has one), so the
    count each batch ran with is seen here."""
    seen = set()
    search = inference_module.beam_search

    def watched(*args, **kwargs):
        seen.add(torch.get_num_threads())
        return search(*args, **kwargs)

    monkeypatch.setattr(inference_module, "beam_search", watched)
    code, out, err = run_cli(monkeypatch, capsys, "generate", tiny_data_dir, "--split", "valid", "--path",
                             untrained_checkpoint, "--beam", "1", "--max-len-b", "2", "--batch-size", "4",
                             "--threads", threads, "--workers", workers)
    assert code == 0, err
    assert seen == {each} and each != THREADS


def test_serve_sets_the_threads_before_loading_the_model(monkeypatch):
    pytest.importorskip("uvicorn")
    from nmt.generation.translator import Translator
    from nmt.options import build
    from nmt.serving.options import ServeOptions
    from nmt.serving.server import serve

    def loaded(*args, **kwargs):
        raise RuntimeError(f"loading with {torch.get_num_threads()} threads")

    monkeypatch.setattr(Translator, "from_checkpoint", loaded)
    with pytest.raises(RuntimeError, match="loading with 3 threads"):
        serve(build(ServeOptions, {"threads": 3}))


def test_train_computes_with_the_threads_given_and_gives_the_callers_back(tiny_data_dir, tmp_path, monkeypatch):
    from nmt.training.trainer import Trainer, train

    seen = []
    fit = Trainer.fit

    def watched(self):
        seen.append(torch.get_num_threads())
        return fit(self)

    monkeypatch.setattr(Trainer, "fit", watched)
    train(tiny_config(tiny_data_dir, tmp_path / "run", max_update=1, valid_subset="none", check_decoding=False,
                      threads=2))
    assert seen == [2] != [THREADS]
    assert torch.get_num_threads() == THREADS


def test_generate_from_python_gives_the_callers_threads_back(untrained_checkpoint, tiny_data_dir, tmp_path):
    from nmt.generation.generate import generate
    from nmt.generation.options import GenerateOptions
    from nmt.options import build

    generate(build(GenerateOptions, {"data": str(tiny_data_dir), "split": "valid", "path": [str(untrained_checkpoint)],
                                     "beam": 1, "max_len_b": 2, "threads": 3, "output": str(tmp_path / "out.txt")}),
             show_progress=False)
    assert torch.get_num_threads() == THREADS != 3


def test_processes_share_the_threads_at_least_one_each():
    use_threads(5, processes=2)
    assert torch.get_num_threads() == 2
    use_threads(1, processes=4)
    assert torch.get_num_threads() == 1
    use_threads(None, processes=4)  # unset: torch's count stays
    assert torch.get_num_threads() == 1


def test_a_recipe_gives_threads(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("data: data-bin\ntrain:\n  threads: 2\n")
    assert load_train_config({}, recipe).compute.threads == 2
    assert load_train_config({"threads": "3"}, recipe).compute.threads == 3  # the command line wins


@pytest.mark.parametrize("command", ["generate", "serve", "train"])
@pytest.mark.parametrize("threads", ["0", "-1"])
def test_threads_below_one_are_a_one_line_error(monkeypatch, capsys, command, threads):
    code, out, err = run_cli(monkeypatch, capsys, command, "--threads", threads)
    assert code == 1 and out == ""
    assert err.strip() == f"error: --threads must be at least 1, got {threads}"
