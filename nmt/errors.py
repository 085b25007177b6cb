"""The one exception type the CLI turns into a one-line message instead of a traceback."""


class NmtError(Exception):
    """An error the user can fix: a bad path, option, file or checkpoint."""
