"""`nmt` starts itself again with glibc's huge pages for malloc where asked for and to be had (nmt/huge_pages.py)."""

import os
import sys

import pytest
from conftest import run_nmt

import nmt.__main__
from nmt import huge_pages

ASKED = "glibc.malloc.hugetlb=1"


ON = {"NMT_HUGE_PAGES": "1"}


@pytest.mark.parametrize("environ, mode, glibc, expected", [
    (ON, "madvise", (2, 36), ASKED),
    ({"NMT_HUGE_PAGES": " On "}, "madvise", (2, 36), ASKED),
    ({"NMT_HUGE_PAGES": "true"}, "madvise", (2, 36), ASKED),
    ({"NMT_HUGE_PAGES": "2"}, "madvise", (2, 36), None),  # not a word for on
    ({**ON, "GLIBC_TUNABLES": "glibc.malloc.arena_max=1"}, "madvise", (2, 35), f"glibc.malloc.arena_max=1:{ASKED}"),
    ({}, "madvise", (2, 36), None),  # not asked for: they cost on some CPUs
    ({"NMT_HUGE_PAGES": "0"}, "madvise", (2, 36), None),
    (ON, "always", (2, 36), None),  # every page may be huge already
    (ON, "never", (2, 36), None),
    (ON, None, (2, 36), None),  # a kernel without transparent huge pages
    (ON, "madvise", (2, 34), None),  # glibc before the tunable
    (ON, "madvise", None, None),  # another C library
    ({**ON, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", (2, 36), None),  # the user's choice
    ({**ON, huge_pages.RESTARTED: "1"}, "madvise", (2, 36), None),  # glibc dropped the tunable: never a loop
])
def test_the_tunable_is_added_only_where_asked_for_and_it_gives_huge_pages_not_had_already(environ, mode, glibc,
                                                                                             expected):
    environ = {"PATH": "/bin", **environ}
    got = huge_pages.environment_with_huge_pages(environ, mode, glibc)
    if expected is None:
        assert got is None
    else:
        assert got == {**environ, "GLIBC_TUNABLES": expected, huge_pages.RESTARTED: "1"}


def test_the_command_starts_again_as_it_was_started_with_the_tunable(monkeypatch):
    started = []
    monkeypatch.setattr(huge_pages, "transparent_huge_pages", lambda: "madvise")
    monkeypatch.setattr(huge_pages, "glibc_version", lambda: (2, 36))
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(sys, "orig_argv", ["python3", "-X", "utf8", "/venv/bin/nmt", "generate", "--input", "-"])
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setenv("NMT_HUGE_PAGES", "1")
    monkeypatch.delenv(huge_pages.RESTARTED, raising=False)
    monkeypatch.setattr(os, "execve", lambda *args: started.append(args))
    huge_pages.restart_with_huge_pages()
    (executable, argv, environ), = started
    assert executable == sys.executable
    assert argv == [sys.executable, "-X", "utf8", "/venv/bin/nmt", "generate", "--input", "-"]
    assert environ["GLIBC_TUNABLES"] == ASKED and environ["PATH"] == os.environ["PATH"]


@pytest.mark.parametrize("program, restarts", [
    ("/venv/bin/nmt", True), (nmt.__main__.__file__, True),  # the console script; python -m nmt
    ("/usr/bin/my_service.py", False), ("/venv/lib/python3.12/site-packages/pytest/__main__.py", False)])
def test_only_nmt_itself_starts_again_never_a_program_that_calls_its_main(monkeypatch, program, restarts):
    called = []
    monkeypatch.setattr(sys, "argv", [program, "generate", "--help"])
    monkeypatch.setattr(nmt.__main__, "restart_with_huge_pages", lambda: called.append(True))
    monkeypatch.setattr(nmt.__main__, "tune_for_decoding", lambda: None)
    with pytest.raises(SystemExit):
        nmt.__main__.main()
    assert bool(called) == restarts


@pytest.mark.skipif(huge_pages.environment_with_huge_pages(ON, huge_pages.transparent_huge_pages(),
                                                           huge_pages.glibc_version()) is None,
                    reason="no huge pages to ask glibc for here (needs Linux in madvise mode, glibc 2.35+)")
def test_generate_runs_with_huge_pages_where_asked_and_says_so(untrained_checkpoint, monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("NMT_HUGE_PAGES", raising=False)
    monkeypatch.delenv(huge_pages.RESTARTED, raising=False)
    done = run_nmt("generate", "--path", untrained_checkpoint, "--input", "-", stdin="1 2 3\n")
    assert done.returncode == 0 and "malloc in 4 KiB pages" in done.stderr, done.stderr
    monkeypatch.setenv("NMT_HUGE_PAGES", "1")
    done = run_nmt("generate", "--path", untrained_checkpoint, "--input", "-", stdin="1 2 3\n")
    assert done.returncode == 0, done.stderr
    assert f"malloc in 2 MiB pages ({ASKED})" in done.stderr
