"""``kvslots convert-config -o FILE`` writes FILE whole or not at all (kvslots.cli.write_file):
the file was opened with O_TRUNC and then written, so a write that failed part way (a full disk,
``ulimit -f``, an I/O error, a Ctrl-C) destroyed an existing FILE. Now a temporary file beside it
is filled, synced and renamed over it; a failure leaves FILE byte-for-byte as it was and no
temporary file behind."""

from __future__ import annotations

import errno
import os
import resource
import stat
import subprocess
import sys

import pytest

from kvslots import cli

YAML = "speculative_config:\n  decoding_type: NGram\n  max_draft_len: 2\n"
OLD = b"--max-num-seqs 1\n"  # what a previous run wrote


def _setup(tmp_path, mode=0o640):
    f = tmp_path / "e.yaml"
    f.write_text(YAML)
    dest = tmp_path / "flags.txt"
    dest.write_bytes(OLD)
    os.chmod(dest, mode)
    return f, dest


def test_a_write_cut_short_by_ulimit_leaves_the_old_file(tmp_path):
    # The old code truncated the file, wrote 10 bytes ("--speculat") and said exit 2.
    f, dest = _setup(tmp_path)
    before = sorted(os.listdir(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "kvslots", "convert-config", str(f), "-q", "-o", str(dest)],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (len(OLD), len(OLD))))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"kvslots convert-config: error: {dest}: cannot write: File too large\n", proc.stderr
    assert dest.read_bytes() == OLD
    assert stat.S_IMODE(dest.stat().st_mode) == 0o640
    assert sorted(os.listdir(tmp_path)) == before  # no temporary file left


@pytest.mark.parametrize("where, error, status", [
    ("fsync", OSError(errno.EIO, "Input/output error"), 2),
    ("write", OSError(errno.ENOSPC, "No space left on device"), 2),
    ("write", KeyboardInterrupt(), 130),  # a Ctrl-C part way
])
def test_a_failure_part_way_leaves_the_old_file_and_no_temporary(tmp_path, capsys, monkeypatch, where, error, status):
    f, dest = _setup(tmp_path)
    before = sorted(os.listdir(tmp_path))
    real = getattr(os, where)
    calls = []

    def failing(fd, *rest):
        # Only the output file's descriptor fails (not stderr's, nor a directory's fsync).
        if fd > 2 and not calls:
            calls.append(fd)
            if where == "write":
                real(fd, bytes(rest[0])[:5])  # part of it written first
            raise error
        return real(fd, *rest)

    monkeypatch.setattr(os, where, failing)
    capsys.readouterr()
    assert cli.main(["convert-config", str(f), "-q", "-o", str(dest)]) == status
    monkeypatch.undo()
    _, err = capsys.readouterr()
    assert err.count("\n") == 1, err
    if status == 2:
        assert err == f"kvslots convert-config: error: {dest}: cannot write: {error.strerror}\n", err
    assert calls, f"os.{where} was never called on the output"
    assert dest.read_bytes() == OLD
    assert sorted(os.listdir(tmp_path)) == before


def test_the_new_file_is_complete_and_synced_before_it_replaces_the_old(tmp_path, monkeypatch):
    f, dest = _setup(tmp_path)
    real_replace, real_fsync = os.replace, os.fsync
    synced, seen = [], []

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    def replace(src, dst):
        seen.append((os.path.dirname(src), open(src, "rb").read(), dest.read_bytes(), src in synced))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    assert cli.main(["convert-config", str(f), "-q", "-o", str(dest)]) == 0
    monkeypatch.undo()
    new = dest.read_bytes()
    assert new.startswith(b"--speculative-config ") and new.endswith(b"\n")
    # Renamed from beside it (one file system), whole and on disk, while the old file was intact.
    assert seen == [(str(tmp_path), new, OLD, True)], seen
    assert stat.S_IMODE(dest.stat().st_mode) == 0o640  # the old file's mode, not the temporary's
    assert sorted(os.listdir(tmp_path)) == ["e.yaml", "flags.txt"]


def test_a_new_file_gets_the_umask_and_a_link_is_kept(tmp_path):
    # Controls (the old code did the same): a new file is 0666 less the umask; -o naming a link
    # replaces the file it names and keeps the link.
    f = tmp_path / "e.yaml"
    f.write_text(YAML)
    old_umask = os.umask(0o027)
    try:
        assert cli.main(["convert-config", str(f), "-q", "-o", str(tmp_path / "new.txt")]) == 0
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE((tmp_path / "new.txt").stat().st_mode) == 0o640
    (tmp_path / "real.txt").write_bytes(OLD)
    os.symlink("real.txt", tmp_path / "link.txt")
    assert cli.main(["convert-config", str(f), "-q", "-o", str(tmp_path / "link.txt")]) == 0
    assert os.readlink(tmp_path / "link.txt") == "real.txt"
    assert (tmp_path / "real.txt").read_bytes() == (tmp_path / "new.txt").read_bytes()


def test_a_refused_conversion_leaves_the_file(tmp_path, capsys):
    f, dest = _setup(tmp_path)
    f.write_text("speculative_config:\n  decoding_type: Eagle\n  max_draft_len: -3\n")
    assert cli.main(["convert-config", str(f), "-q", "-o", str(dest)]) == 2
    assert dest.read_bytes() == OLD
    assert sorted(os.listdir(tmp_path)) == ["e.yaml", "flags.txt"]


def test_dev_stdout_is_written_as_a_stream(tmp_path):
    # /dev/stdout on a pipe resolves to no path: it is written in place, as before.
    f = tmp_path / "e.yaml"
    f.write_text("max_batch_size: 4\n")
    proc = subprocess.run([sys.executable, "-m", "kvslots", "convert-config", str(f), "-q", "-o", "/dev/stdout"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "--max-num-seqs 4\n", "")


@pytest.mark.parametrize("output", ["{yaml}/", "{yaml}/.", "{tmp}/new/", "{tmp}/new/."])
def test_a_path_naming_a_directory_is_refused_and_writes_nothing(tmp_path, capsys, output):
    # "e.yaml/" is no file name: open() refused it (as the code before write_file did); resolved
    # to e.yaml, it replaced the input (f891be3), and "new/" made a file "new".
    f, dest = _setup(tmp_path)
    output = output.format(yaml=f, tmp=tmp_path)
    capsys.readouterr()
    assert cli.main(["convert-config", str(f), "-q", "-o", output]) == 2
    _, err = capsys.readouterr()
    assert err.startswith(f"kvslots convert-config: error: {output}: cannot write: ") and err.count("\n") == 1, err
    assert f.read_text() == YAML and dest.read_bytes() == OLD
    assert sorted(os.listdir(tmp_path)) == ["e.yaml", "flags.txt"]


def test_dash_is_stdout(tmp_path, capsys, monkeypatch):
    # A file named "-" was made in the working directory.
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "e.yaml"
    f.write_text("max_batch_size: 4\n")
    capsys.readouterr()
    assert cli.main(["convert-config", str(f), "-q", "-o", "-"]) == 0
    assert capsys.readouterr().out == "--max-num-seqs 4\n"
    assert sorted(os.listdir(tmp_path)) == ["e.yaml"]


def test_a_file_the_user_may_not_write_is_not_replaced(tmp_path, capsys, monkeypatch):
    # open(O_TRUNC) refused a user's read-only file (EACCES); renamed over from a writable
    # directory, it would be replaced. (The tests run as root, for whom every file is writable:
    # os.access answers as for another user here.)
    f, dest = _setup(tmp_path, mode=0o444)
    real = os.open

    def refusing(p, flags, *rest, **kw):  # the kernel's answer to another user
        if str(p) == str(dest) and flags & os.O_WRONLY:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real(p, flags, *rest, **kw)

    monkeypatch.setattr(os, "open", refusing)
    capsys.readouterr()
    assert cli.main(["convert-config", str(f), "-q", "-o", str(dest)]) == 2
    _, err = capsys.readouterr()
    assert err == f"kvslots convert-config: error: {dest}: cannot write: Permission denied\n", err
    assert dest.read_bytes() == OLD
    assert sorted(os.listdir(tmp_path)) == ["e.yaml", "flags.txt"]


# Where renaming a new file over FILE would lose something or cannot be done, FILE is written in
# place as before f891be3 (a review found each of these refused or changed by the rename).


def _convert(f, dest) -> None:
    assert cli.main(["convert-config", str(f), "-q", "-o", str(dest)]) == 0
    assert dest.read_bytes() != OLD and b"--speculative-config" in dest.read_bytes()


def test_a_file_in_a_directory_that_takes_no_new_file_is_written_in_place(tmp_path, monkeypatch):
    # A writable file in a root-owned directory (EACCES), a sticky one (EPERM), a read-only one
    # (EROFS) was refused: the temporary file could not be made.
    f, dest = _setup(tmp_path)
    inode = dest.stat().st_ino
    real = os.open

    def no_new_files(p, flags, *rest, **kw):
        if os.path.basename(str(p)).startswith(".kvslots-"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real(p, flags, *rest, **kw)

    monkeypatch.setattr(os, "open", no_new_files)
    _convert(f, dest)
    assert dest.stat().st_ino == inode and sorted(os.listdir(tmp_path)) == ["e.yaml", "flags.txt"]


@pytest.mark.parametrize("code", [errno.EBUSY, errno.EXDEV])
def test_a_file_that_is_a_mount_point_is_written_in_place(tmp_path, monkeypatch, code):
    # docker run -v ./flags.txt:/app/flags.txt: renaming over a mount point is EBUSY.
    f, dest = _setup(tmp_path)
    real = os.replace

    def busy(a, b, *rest, **kw):
        if str(b) == str(dest):
            raise OSError(code, os.strerror(code))
        return real(a, b, *rest, **kw)

    monkeypatch.setattr(os, "replace", busy)
    _convert(f, dest)
    assert sorted(os.listdir(tmp_path)) == ["e.yaml", "flags.txt"]


def test_a_file_with_another_hard_link_is_written_in_place(tmp_path):
    f, dest = _setup(tmp_path)
    other = tmp_path / "other.txt"
    os.link(dest, other)
    _convert(f, dest)
    assert other.read_bytes() == dest.read_bytes()  # replaced, the other name kept the old text


def test_a_file_with_extended_attributes_is_written_in_place(tmp_path):
    f, dest = _setup(tmp_path)
    try:
        os.setxattr(dest, "user.kvslots-test", b"1")
    except OSError as e:
        pytest.skip(f"this file system takes no user extended attributes ({e.strerror})")
    _convert(f, dest)
    assert os.getxattr(dest, "user.kvslots-test") == b"1"  # a new file would not have it


def test_a_file_of_another_owner_is_written_in_place_by_a_user_who_cannot_give_it(tmp_path, monkeypatch):
    # A non-root user writing someone else's group-writable file: the rename made it theirs.
    f, dest = _setup(tmp_path)
    inode = dest.stat().st_ino
    monkeypatch.setattr(os, "geteuid", lambda: dest.stat().st_uid + 1)
    _convert(f, dest)
    assert dest.stat().st_ino == inode


def test_the_temporary_file_is_never_more_open_than_the_file_it_replaces(tmp_path, monkeypatch):
    f, dest = _setup(tmp_path, mode=0o600)
    real, modes = os.open, []

    def recording(p, flags, mode=0o777, *rest, **kw):
        if os.path.basename(str(p)).startswith(".kvslots-"):
            modes.append(mode)
        return real(p, flags, mode, *rest, **kw)

    monkeypatch.setattr(os, "open", recording)
    _convert(f, dest)
    assert modes == [0o600] and stat.S_IMODE(dest.stat().st_mode) == 0o600


def test_a_read_only_file_system_is_named_as_such(tmp_path, capsys, monkeypatch):
    f, dest = _setup(tmp_path)
    real = os.open

    def read_only(p, flags, *rest, **kw):
        if str(p) == str(dest) and flags & os.O_WRONLY:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real(p, flags, *rest, **kw)

    monkeypatch.setattr(os, "open", read_only)
    capsys.readouterr()
    assert cli.main(["convert-config", str(f), "-q", "-o", str(dest)]) == 2
    assert capsys.readouterr().err.endswith("cannot write: Read-only file system\n")
    assert dest.read_bytes() == OLD
