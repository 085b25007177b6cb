"""Training curves from a run's ``metrics.jsonl``: train and valid loss, valid BLEU (when the run
computed it), learning rate and tokens/s against updates."""

from __future__ import annotations

from pathlib import Path

from nmt.errors import NmtError
from nmt.log import logger
from nmt.plot.figures import pyplot, save_figure
from nmt.plot.options import PlotCurvesOptions
from nmt.training.metrics_file import FILE_NAME as METRICS_FILE
from nmt.training.metrics_file import read_metrics


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
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False,
                               layout="constrained")
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
    written = save_figure(figure, options.output)
    plt.close(figure)
    logger.info("wrote %s", written)
    return written

