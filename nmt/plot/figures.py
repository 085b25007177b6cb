"""matplotlib, imported only when a figure is drawn, and PNG files written atomically."""

from __future__ import annotations

from pathlib import Path

from nmt.errors import NmtError
from nmt.files import atomic_write


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

