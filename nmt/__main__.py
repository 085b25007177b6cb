"""``python -m nmt`` and the ``nmt`` console script.

Loading the command's libraries (torch above all) takes seconds; a Ctrl-C in them ends the
command quietly with 130, as it does once the command runs, not with a traceback."""

import sys


def main() -> None:
    try:
        from nmt.cli import main as run
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    run()


if __name__ == "__main__":
    main()
