"""``nmt plot``: attention maps in the manner of the paper's Figures 3-5, and training curves.

Attention: the encoder self-attention of one layer (every head, or one), or the cross-attention
of the model's own translation of the text, as heat maps with the tokens on both axes. Curves:
train and valid loss, valid BLEU (when the run computed it), learning rate and tokens/s against
updates, read from the run's ``metrics.jsonl``. matplotlib is an optional extra.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from nmt.data.vocabulary import BOS_ID, EOS_ID
from nmt.errors import NmtError
from nmt.generation.ensemble import Ensemble
from nmt.files import atomic_write, refuse_overwriting
from nmt.log import logger
from nmt.models.attention_maps import attention_maps, layer_index
from nmt.options import check_values
from nmt.training.metrics_file import FILE_NAME as METRICS_FILE, read_metrics


@dataclass(frozen=True)
class PlotAttentionOptions:
    path: str = field(metadata={"help": "Checkpoint whose attention to draw."})
    text: str = field(metadata={"help": "Source sentence (raw text)."})
    output: str = field(default="attention.png", metadata={"help": "PNG file to write.", "flags": ["--output", "-o"]})
    kind: Literal["encoder", "cross"] = field(default="encoder", metadata={
        "help": "encoder: the source's self-attention; cross: the translation's attention to the source."})
    layer: int | None = field(default=None, metadata={
        "help": "Layer, counted from 1 at the bottom; unset: the penultimate, as in the paper's figures.",
        "min": 1})
    head: int | None = field(default=None, metadata={"help": "One head, counted from 1; unset: every head.",
                                                     "min": 1})

    def __post_init__(self) -> None:
        check_values(self)
        refuse_overwriting("--output", self.output, {"--path": self.path})


@dataclass(frozen=True)
class PlotCurvesOptions:
    save_dir: str = field(metadata={"help": "Training save dir holding metrics.jsonl.", "argument": True,
                                    "metavar": "SAVE_DIR"})
    output: str = field(default="curves.png", metadata={"help": "PNG file to write.", "flags": ["--output", "-o"]})

    def __post_init__(self) -> None:
        refuse_overwriting("--output", self.output, {"training metrics": Path(self.save_dir) / METRICS_FILE})


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise NmtError("nmt plot needs matplotlib: pip install 'nmt[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, output: str | Path) -> Path:
    """Write the PNG atomically: a failed plot never leaves half an image."""
    with atomic_write(output, mode="wb", encoding=None) as handle:
        figure.savefig(handle, format="png", dpi=120, bbox_inches="tight")
    return Path(output)


def token_labels(vocab, ids: list[int]) -> list[str]:
    return ["</s>" if i == EOS_ID else vocab.piece(i).replace("\u2581", "_") for i in ids]


def plot_attention(options: PlotAttentionOptions) -> Path:
    plt = pyplot()
    from nmt.generation.inference import prepare_model, translate_ids

    model, vocabs = prepare_model(options.path, torch.device("cpu"))
    if isinstance(model, Ensemble):
        raise NmtError("nmt plot attention draws one model's attention: give one --path, not an ensemble")
    source = vocabs.source.encode(options.text) + [EOS_ID]
    if len(source) < 2:
        raise NmtError("--text is empty: nothing to draw")
    check_drawable(len(source), "--text")
    src = torch.tensor([source])
    if options.kind == "encoder":
        index = layer_index(options.layer, len(model.encoder_layers), "--layer")
        weights = attention_maps(model, src, torch.tensor([[BOS_ID]])).encoder[index][0]
        rows = columns = token_labels(vocabs.source, source)
        title = "encoder self-attention"
    else:
        index = layer_index(options.layer, len(model.decoder_layers), "--layer")
        target = translate_ids(model, [np.asarray(source)])[0][0].tokens
        check_drawable(len(target), "its translation")
        weights = attention_maps(model, src, torch.tensor([[BOS_ID] + target[:-1]])).cross[index][0]
        rows, columns = token_labels(vocabs.target, target), token_labels(vocabs.source, source)
        title = f"cross-attention of the translation \u201c{vocabs.target.decode(target)}\u201d"
    heads = range(weights.size(0))
    if options.head is not None:
        if options.head > weights.size(0):
            raise NmtError(f"--head must be between 1 and {weights.size(0)} for this model, got {options.head}")
        heads = [options.head - 1]
    figure = draw_heads(plt, weights.numpy(), list(heads), rows, columns, f"{title}, layer {index + 1}")
    written = save_figure(figure, options.output)
    plt.close(figure)
    logger.info("wrote %s", written)
    return written


MOST_TOKENS_DRAWN = 100  # a side of a heat map: 4 heads of 100 x 100 cells are a 12,000-pixel-wide figure


def check_drawable(tokens: int, what: str) -> None:
    if tokens > MOST_TOKENS_DRAWN:
        raise NmtError(f"{what} has {tokens} tokens: a heat map takes at most {MOST_TOKENS_DRAWN} a side; "
                       "plot a shorter sentence")


def draw_heads(plt, weights: np.ndarray, heads: list[int], rows: list[str], columns: list[str], title: str):
    """One heat map per head: queries down, keys across, one shared colour scale from 0 to 1."""
    across = min(len(heads), 4)
    down = math.ceil(len(heads) / across)
    cell = 0.28
    width = max(3.0, cell * len(columns) + 1.2) * across
    height = max(3.0, cell * len(rows) + 1.2) * down
    figure, axes = plt.subplots(down, across, figsize=(width, height), squeeze=False)
    image = None
    for slot, ax in enumerate(axes.flat):
        if slot >= len(heads):
            ax.axis("off")
            continue
        head = heads[slot]
        image = ax.imshow(weights[head], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_title(f"head {head + 1}", fontsize=10)
        ax.set_xticks(range(len(columns)), columns, rotation=90, fontsize=8)
        ax.set_yticks(range(len(rows)), rows if slot % across == 0 else [], fontsize=8)
        ax.set_xlabel("attended to (keys)", fontsize=8)
        if slot % across == 0:  # the row labels once per row of panels: they would overlap the next panel
            ax.set_ylabel("attending (queries)", fontsize=8)
    figure.suptitle(title, fontsize=11)
    figure.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="attention probability")
    return figure


def plot_curves(options: PlotCurvesOptions) -> Path:
    plt = pyplot()
    path = Path(options.save_dir) / METRICS_FILE
    if not Path(options.save_dir).is_dir():
        raise NmtError(f"no save dir {options.save_dir}: give the --save-dir of a training run")
    if not path.is_file():
        raise NmtError(f"{path} not found: train with this version of nmt to record metrics")
    records = read_metrics(path)
    train = [r for r in records if r.get("kind") == "train"]
    valid = [r for r in records if r.get("kind") == "valid"]
    if not train and not valid:
        raise NmtError(f"{path} holds no training records yet")

    def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
        pairs = [(r["update"], r[key]) for r in rows if key in r]
        return [u for u, _ in pairs], [v for _, v in pairs]

    subsets = {name: [r for r in valid if r.get("subset", "valid") == name]
               for name in dict.fromkeys(r.get("subset", "valid") for r in valid)}  # valid, valid1, ...
    has_bleu = any("bleu" in r for r in valid)
    panels = ["loss"] + (["bleu"] if has_bleu else []) + ["lr", "speed"]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        if panel == "loss":
            ax.plot(*series(train, "loss"), label="train loss")
            for name, rows in subsets.items():
                ax.plot(*series(rows, "loss"), marker="o", label=f"{name} loss")
            ax.set_ylabel("label-smoothed loss (nats/token)")
            ax.legend(fontsize=8)
        elif panel == "bleu":
            for name, rows in subsets.items():
                ax.plot(*series(rows, "bleu"), marker="o", label=name)
            ax.set_ylabel("validation BLEU")
            ax.legend(fontsize=8)
        elif panel == "lr":
            ax.plot(*series(train, "lr"), color="tab:purple")
            ax.set_ylabel("learning rate")
            ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        else:
            ax.plot(*series(train, "tokens_per_second"), color="tab:red")
            ax.set_ylabel("target tokens/s")
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
    figure.suptitle(f"training curves: {options.save_dir}", fontsize=11)
    figure.tight_layout()
    written = save_figure(figure, options.output)
    plt.close(figure)
    logger.info("wrote %s", written)
    return written
