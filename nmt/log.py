"""Logging set-up shared by every subcommand: rich text on stderr, or JSON lines."""

from __future__ import annotations

import json
import logging
import sys
import time

from rich.console import Console
from rich.logging import RichHandler

logger = logging.getLogger("nmt")
stderr_console = Console(stderr=True)

# Set by setup_logging; read by the CLI to decide whether errors show a traceback and progress bars show.
state = {"verbose": 0, "progress": True}


class JsonLinesFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)),
            "level": record.levelname.lower(),
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(verbose: int = 0, quiet: bool = False, log_format: str = "text") -> None:
    """-v shows debug messages (and tracebacks); --quiet shows warnings and errors only."""
    state["verbose"] = verbose
    state["progress"] = not quiet and log_format == "text"
    level = logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO
    if log_format == "json":
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonLinesFormatter())
    else:
        handler = RichHandler(console=stderr_console, show_path=False, rich_tracebacks=True,
                              log_time_format="[%X]")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
