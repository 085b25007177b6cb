"""``python -m nmt`` and the ``nmt`` console script.

Loading the command's libraries (torch above all) takes seconds; a Ctrl-C in them ends the
command quietly with 130, as it does once the command runs, not with a traceback."""

import sys
from pathlib import Path

from nmt.huge_pages import restart_with_huge_pages


def main() -> None:
    program = Path(sys.argv[0])  # the console script, or this file under `python -m nmt`; never another program
    if program.name == "nmt" or program.resolve() == Path(__file__).resolve():
        restart_with_huge_pages()
    try:
        from nmt.cli import main as run
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    run()


if __name__ == "__main__":
    main()
