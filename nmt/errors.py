"""The one exception type the CLI turns into a one-line message instead of a traceback."""


class NmtError(Exception):
    """An error the user can fix: a bad path, option, file or checkpoint."""


class Stopped(BaseException):
    """A run stopped by a signal (Ctrl-C, SIGTERM); the CLI exits 128 + ``signum`` (130, 143).

    A BaseException like KeyboardInterrupt, so that no ``except Exception`` swallows it.
    """

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message)
        self.signum = int(signum)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def install_hint(extra: str) -> str:
    """How to install an optional extra. nmt installs from its checkout: the package index's `nmt`
    is another project, so `pip install 'nmt[serve]'` would install someone else's code."""
    return f"pip install -e '.[{extra}]' in nmt's checkout"
