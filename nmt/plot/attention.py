"""Attention heat maps: the encoder self-attention of one layer (every head, or one), or the
cross-attention of the model's own translation of the text, with the tokens on both axes."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from nmt.data.vocabulary import BOS_ID, EOS_ID
from nmt.errors import NmtError
from nmt.generation.ensemble import Ensemble
from nmt.generation.inference import prepare_model, translate_ids
from nmt.log import logger
from nmt.models.attention_maps import attention_maps, layer_index
from nmt.plot.figures import pyplot, save_figure
from nmt.plot.options import PlotAttentionOptions


def token_labels(vocab, ids: list[int]) -> list[str]:
    return ["</s>" if i == EOS_ID else vocab.piece(i).replace("\u2581", "_") for i in ids]


def plot_attention(options: PlotAttentionOptions) -> Path:
    plt = pyplot()
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
    figure, axes = plt.subplots(down, across, figsize=(width, height), squeeze=False, layout="constrained")
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

