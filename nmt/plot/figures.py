"""matplotlib, imported only when a figure is drawn, and PNG files written atomically."""

from __future__ import annotations

from pathlib import Path

from nmt.errors import NmtError, install_hint
from nmt.files import atomic_write
from nmt.plot.options import image_kind


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise NmtError(f"nmt plot needs matplotlib: {install_hint('plot')}") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, output: str | Path) -> Path:
    """Write the image atomically, in the format its suffix names: a failed plot never leaves half an image."""
    with atomic_write(output, mode="wb", encoding=None) as handle:
        figure.savefig(handle, format=image_kind(str(output)), dpi=120, bbox_inches="tight")
    return Path(output)

