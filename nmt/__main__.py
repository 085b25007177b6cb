"""``python -m nmt`` and the ``nmt`` console script.

As nmt itself (never as a program that calls this ``main``), the subcommands that decode tune the
process for it before anything else is loaded: `nmt generate` and `nmt serve` take one malloc arena
and small oneDNN caches (nmt/tuning.py), and with ``NMT_HUGE_PAGES=1`` `nmt generate` starts again
with huge pages for malloc (nmt/huge_pages.py: they paid on one CPU and cost on two). `nmt train`
and `nmt run` take the small oneDNN caches only: bf16 training meets new product shapes at every
batch too. The other subcommands run in the process as Python started it: training's speed and
peak memory did not move with huge pages on a Xeon, so they are never asked for there.

Loading the command's libraries (torch above all) takes seconds; a Ctrl-C in them ends the
command quietly with 130, as it does once the command runs, not with a traceback."""

import sys
from pathlib import Path

from nmt.huge_pages import restart_with_huge_pages
from nmt.tuning import bound_onednn_caches, tune_for_decoding

HUGE_PAGES_FOR = ("generate",)  # where huge pages may pay (NMT_HUGE_PAGES=1): decoding
TUNED_FOR = ("generate", "serve")
TRAINING = ("train", "run")


def main() -> None:
    program = Path(sys.argv[0])  # the console script, or this file under `python -m nmt`; never another program
    subcommand = sys.argv[1] if len(sys.argv) > 1 else None
    if program.name == "nmt" or program.resolve() == Path(__file__).resolve():
        if subcommand in HUGE_PAGES_FOR:
            restart_with_huge_pages()
        if subcommand in TUNED_FOR:
            tune_for_decoding()
        elif subcommand in TRAINING:
            bound_onednn_caches()
    try:
        from nmt.cli import main as run
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    run()


if __name__ == "__main__":
    main()
