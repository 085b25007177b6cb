"""nmt plot: attention maps and training curves are written as real PNG images."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from conftest import run_cli

from nmt.errors import NmtError
from nmt.plot.attention import plot_attention
from nmt.plot.curves import plot_curves
from nmt.plot.options import PlotAttentionOptions, PlotCurvesOptions
from nmt.training.metrics_file import MetricsFile

matplotlib = pytest.importorskip("matplotlib", reason="nmt plot needs matplotlib: pip install -e '.[plot]'")
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def checkpoint(untrained_checkpoint):
    return untrained_checkpoint


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.parametrize("kind, head", [("encoder", None), ("encoder", 2), ("cross", None)])
def test_attention_plots_are_pngs(checkpoint, tmp_path, kind, head):
    out = tmp_path / f"{kind}.png"
    plot_attention(PlotAttentionOptions(path=str(checkpoint), text="one hundred and twenty three", output=str(out),
                                        kind=kind, head=head))
    width, height = png_size(out)
    assert width > 200 and height > 200
    if head is None:  # four heads side by side are wider than one
        one = tmp_path / "one.png"
        plot_attention(PlotAttentionOptions(path=str(checkpoint), text="one hundred and twenty three",
                                            output=str(one), kind=kind, head=1))
        assert png_size(one)[0] < width


def test_attention_plot_refuses_a_missing_layer(checkpoint, tmp_path):
    with pytest.raises(NmtError, match="--layer must be between 1 and 2"):
        plot_attention(PlotAttentionOptions(path=str(checkpoint), text="one", output=str(tmp_path / "x.png"),
                                            layer=3))
    assert not (tmp_path / "x.png").exists()


def test_curves_plot_from_metrics_file(tmp_path):
    metrics = MetricsFile(tmp_path / "metrics.jsonl", resume_update=0)
    for update in range(1, 11):
        metrics.append({"kind": "train", "update": update, "loss": 5.0 / update, "lr": 1e-4 * update,
                        "tokens_per_second": 1000.0})
        if update % 5 == 0:
            metrics.append({"kind": "valid", "update": update, "loss": 6.0 / update, "bleu": 2.0 * update})
    out = tmp_path / "curves.png"
    plot_curves(PlotCurvesOptions(save_dir=str(tmp_path), output=str(out)))
    width, height = png_size(out)
    assert width > 4 * height  # four panels in a row: loss, BLEU, lr, tokens/s


def test_curves_without_metrics_is_a_one_line_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "nmt", "plot", "curves", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.startswith("error:") and "metrics.jsonl not found" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(NmtError, match=r"pip install -e '\.\[plot\]' in nmt's checkout"):
        plot_curves(PlotCurvesOptions(save_dir=str(tmp_path), output=str(tmp_path / "c.png")))


def test_curves_of_a_missing_save_dir_or_onto_the_metrics_file_are_one_line_errors(tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "plot", "curves", str(tmp_path / "nope"))
    assert code == 1 and err.startswith("error: no save dir") and len(err.strip().splitlines()) == 1
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    code, _, err = run_cli(monkeypatch, capsys, "plot", "curves", str(tmp_path), "-o", str(tmp_path / "metrics.jsonl"))
    assert code == 1 and "is also the training metrics" in err
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"


def test_attention_plot_refuses_an_ensemble_and_a_sentence_too_long_to_draw(checkpoint, tmp_path):
    twin = tmp_path.parent / f"{tmp_path.name}-twin.pt"  # another file: a checkpoint named twice is refused anyway
    shutil.copy(checkpoint, twin)
    with pytest.raises(NmtError, match="one model's attention: give one --path"):
        plot_attention(PlotAttentionOptions(path=f"{checkpoint}:{twin}", text="one", output=str(tmp_path / "e.png")))
    with pytest.raises(NmtError, match=r"--text has \d+ tokens: a heat map takes at most 100 a side"):
        plot_attention(PlotAttentionOptions(path=str(checkpoint), text="one two " * 60, output=str(tmp_path / "l.png")))
    assert list(tmp_path.iterdir()) == []


def test_the_image_format_follows_the_suffix(tmp_path):
    from nmt.plot.options import PlotCurvesOptions

    with pytest.raises(NmtError, match=r"^--output c\.jpeg: name a \.png, \.pdf or \.svg file"):
        PlotCurvesOptions(save_dir=str(tmp_path), output="c.jpeg")
    figure = pytest.importorskip("matplotlib.pyplot").figure()
    from nmt.plot.figures import save_figure

    for name, start in (("c.pdf", b"%PDF"), ("c.svg", b"<?xml"), ("c.png", b"\x89PNG")):
        assert save_figure(figure, tmp_path / name).read_bytes().startswith(start)
