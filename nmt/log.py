"""Logging set-up shared by every subcommand: rich text on stderr, or JSON lines.

Rich text is for a terminal; written to a file or a pipe, records are plain lines that are never
wrapped or padded to a console width.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from rich.console import Console
from rich.logging import RichHandler
from rich.text import Text

logger = logging.getLogger("nmt")
stderr_console = Console(stderr=True)
UNBOUNDED_WIDTH = 10_000  # a table written to a file or a pipe keeps its natural width


def stdout_console() -> Console:
    """The console for a command's result (a table): a terminal's width, or, written to a file or a
    pipe, no width limit, so that piped output is never cut to rich's default 80 columns."""
    return Console() if sys.stdout.isatty() else Console(width=UNBOUNDED_WIDTH)

# Set by setup_logging; read by the CLI: tracebacks on errors, progress bars, the log format.
state = {"verbose": 0, "progress": True, "format": "text"}


class JsonLinesFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)),
            "level": record.levelname.lower(),
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        return json.dumps(entry, ensure_ascii=False)


class PlainFormatter(logging.Formatter):
    """``HH:MM:SS LEVEL message`` with any rich markup removed, one line per record."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(message)s", datefmt="%H:%M:%S")

    def formatMessage(self, record: logging.LogRecord) -> str:
        if getattr(record, "markup", False):
            record.message = Text.from_markup(record.message).plain
        return super().formatMessage(record)


def setup_logging(verbose: int = 0, quiet: bool = False, log_format: str = "text") -> None:
    """-v shows debug messages (and tracebacks); --quiet shows warnings and errors only."""
    state["verbose"], state["format"] = verbose, log_format
    state["progress"] = not quiet and log_format == "text"
    level = logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO
    if log_format == "json":
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonLinesFormatter())
    elif not stderr_console.is_terminal:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(PlainFormatter())
    else:
        handler = RichHandler(console=stderr_console, show_path=False, rich_tracebacks=True,
                              log_time_format="[%X]")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
