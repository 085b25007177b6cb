"""same_file: what an output must never be, whatever way its path is spelled; atomic_write's file
modes; atomic_directory's all-or-nothing replacement."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from nmt.errors import NmtError
from nmt.files import atomic_directory, atomic_write, same_file


def test_same_file_sees_through_spellings_and_links(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.txt").write_text("x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.txt").symlink_to("a.txt")
    os.link(tmp_path / "a.txt", tmp_path / "hard.txt")
    (tmp_path / "dir-link").symlink_to("sub")
    assert same_file("a.txt", str(tmp_path / "a.txt"))  # relative vs absolute
    assert same_file(os.path.join(str(tmp_path), "sub", "..", "a.txt"), "a.txt")
    assert same_file("link.txt", "a.txt") and same_file("a.txt", "link.txt")
    assert same_file("hard.txt", "a.txt")
    assert same_file("dir-link/new.txt", "sub/new.txt")  # neither exists yet: one path once resolved
    assert not same_file("a.txt", "b.txt") and not same_file("new.txt", "a.txt")


def test_streams_and_devices_are_written_in_place_and_replace_nothing():
    assert not same_file("-", "-")
    assert not same_file("/dev/null", "/dev/null")


def test_a_replaced_file_keeps_its_mode_and_a_new_one_gets_the_umasks(tmp_path):
    private = tmp_path / "private.hyp"
    private.write_text("old\n")
    private.chmod(0o600)
    with atomic_write(private) as handle:
        handle.write("new\n")
    assert private.read_text() == "new\n" and stat.S_IMODE(private.stat().st_mode) == 0o600
    umask = os.umask(0o027)
    try:
        with atomic_write(tmp_path / "new.hyp") as handle:
            handle.write("x\n")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new.hyp").stat().st_mode) == 0o640


def test_atomic_directory_replaces_the_old_one_only_when_the_block_completes(tmp_path):
    destdir = tmp_path / "out"
    with atomic_directory(destdir) as workdir:
        (workdir / "a").write_text("first")
        assert not destdir.exists()  # nothing there until the block completes
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (destdir / "a").read_text() == "first"
    with pytest.raises(KeyboardInterrupt):
        with atomic_directory(destdir) as workdir:
            (workdir / "a").write_text("second")
            raise KeyboardInterrupt
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (destdir / "a").read_text() == "first"
    with atomic_directory(destdir) as workdir:
        (workdir / "b").write_text("third")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the old one moved aside, then deleted
    assert [p.name for p in destdir.iterdir()] == ["b"]


def test_atomic_directory_where_no_directory_can_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NmtError, match=f"^cannot create a directory in {tmp_path}/file: "):
        with atomic_directory(tmp_path / "file" / "out"):
            pass
    assert (tmp_path / "file").read_text() == "x"


def test_a_symlink_planted_after_the_look_at_a_fifo_is_not_followed(tmp_path, monkeypatch):
    """A FIFO (or device) is written in place; a symlink put in its stead between the look and the open
    would have sent the write to the file it points at."""
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's\n")
    target = tmp_path / "out.fifo"
    os.mkfifo(target)
    real_stat = Path.stat

    def looked_then_swapped(path, *args, **kwargs):
        info = real_stat(path, *args, **kwargs)
        if path == target and stat.S_ISFIFO(info.st_mode):
            path.unlink()
            path.symlink_to(precious)
        return info

    monkeypatch.setattr(Path, "stat", looked_then_swapped)
    with pytest.raises(NmtError, match=f"cannot write {target}"):
        with atomic_write(target) as handle:
            handle.write("x\n")
    assert precious.read_text() == "the user's\n"


def test_a_fifo_put_where_a_checkpoint_was_seen_does_not_block(tmp_path, monkeypatch):
    """Looked at as a file, then replaced by a FIFO: opening that to read by name would wait for a writer."""
    import threading

    from nmt.files import is_zip_file

    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"PK\x03\x04")
    seen = os.stat(checkpoint)
    checkpoint.unlink()
    os.mkfifo(checkpoint)
    monkeypatch.setattr(Path, "stat", lambda path, *args, **kwargs: seen)  # what the look found, before the swap
    answers = []
    looker = threading.Thread(target=lambda: answers.append(is_zip_file(checkpoint)), daemon=True)
    looker.start()
    looker.join(10)
    assert answers == [False]  # opened without waiting, then seen on its descriptor to be no file
