"""The ``kvslots`` command line. Each subcommand lives in its own module, which provides
``add_parser(subparsers)`` registering a parser whose ``func`` default runs it.

Errors have one home here: a :class:`~kvslots.KVSlotsError` a command raises (bad input: a
ConfigError naming the file and field, a ServeError, ...) is one line on stderr,
``kvslots COMMAND: error: MESSAGE`` (``kvslots indexer: MESSAGE``), and exit status 2
(:func:`run_command`)."""

from __future__ import annotations

import argparse
import codecs
import errno
import importlib
import os
import signal
import stat
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from .errors import ConfigError, KVSlotsError

# Modules that contribute subcommands, in --help order.
COMMAND_MODULES = [
    "kvslots._dev.simulate",
    "kvslots.config.cli",
    "kvslots.indexer.cli",
    "kvslots.serve.cli",
    "kvslots.proxy.cli",
    "kvslots.demo.run",
]


class OneLineParser(argparse.ArgumentParser):
    """An argument error is one line, ``PROG: error: MESSAGE (see PROG --help)``, and exit status
    2, as every other bad input is (argparse printed its usage first: many lines)."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        print(one_line(f"{self.prog}: error: {message} (see {self.prog} --help)"), file=sys.stderr)
        raise SystemExit(2)

    def _print_message(self, message: str, file: Any = None) -> None:
        # --help and --version: argparse drops what writing them raises, so a full disk or a
        # closed pipe on stdout was exit status 0 with nothing written. As a command's output
        # (run_command): one line and exit status 2.
        if not message:
            return
        file = file or sys.stderr
        try:
            file.write(message)
            file.flush()
        except AttributeError:  # None: no such stream
            pass
        except OSError as e:
            if file is sys.stderr or e.errno not in _OUTPUT_ERRNOS:
                return  # nowhere to say it
            _stdout_to_devnull()
            print(one_line(f"{self.prog}: error: cannot write the output: {e.strerror or e}"), file=sys.stderr)
            raise SystemExit(2) from None

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        # An option's own value "--" (--topic=--, -k--): Python before 3.13 drops it as if it
        # were the separator, and the option got [] past its type and choices (--port=-- was
        # port [], --format=-- ran as flags, a list reached code expecting a str: tracebacks).
        # Taken as the text "--", as Python 3.13 does: the type and choices then judge it.
        if action.option_strings and arg_strings == ["--"] and action.nargs in (None, "?", "*", "+"):
            value = self._get_value(action, "--")
            self._check_value(action, value)
            return value if action.nargs in (None, "?") else [value]
        return super()._get_values(action, arg_strings)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = OneLineParser(
        prog="kvslots",
        description="KV-cache block slot manager for speculative decoding.",
    )
    parser.add_argument("--version", action="version", version=f"kvslots {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def _stderr_or_devnull() -> None:
    """Started with stderr closed (``2>&-``), Python has no ``sys.stderr`` (None): ``print(...,
    file=sys.stderr)`` then wrote notes and errors to stdout, into the command's output, and
    ``sys.stderr.flush()`` was an AttributeError (exit status 1, its traceback lost). What would
    go to stderr is dropped instead; the exit status still says how it went."""
    if sys.stderr is None:
        try:
            sys.stderr = open(os.devnull, "w", encoding="utf-8")
        except OSError:  # no /dev/null: nothing better to write to
            pass


#: Exit status after a Ctrl-C: 128 + SIGINT, as a shell reports it.
INTERRUPTED_STATUS = 130


def main(argv: list[str] | None = None) -> int:
    prog = "kvslots"
    _stderr_or_devnull()
    if argv is None:  # the program itself (kvslots, python -m kvslots): its signals are ours
        handle_ending_signals()
    try:
        parser = build_parser()
        args, extras = parser.parse_known_args(argv)
        if extras:
            # Said by the command's own parser, as its other argument errors are: argparse's
            # top-level parser said 'kvslots: error: ... (see kvslots --help)' for them. Those
            # before the command (kvslots --bogus simulate) are the top level's: its only options
            # (--help, --version) exit, so all it was given there is unknown, and listed first;
            # the command's own unknown ones are named too (they were left out).
            command = getattr(args, "command", None)
            given = sys.argv[1:] if argv is None else list(argv)
            at = next((i for i, a in enumerate(given) if a == command), None) if command else None
            if at and extras[:at] == given[:at]:
                more = f" (and {' '.join(extras[at:])}, unknown to {parser.prog} {command})" if extras[at:] else ""
                parser.error(f"unrecognized arguments: {' '.join(extras[:at])}{more}")
            sub = next((a.choices[command] for a in parser._actions
                        if isinstance(a, argparse._SubParsersAction) and command in a.choices), parser)
            sub.error(f"unrecognized arguments: {' '.join(extras)}")
        if not getattr(args, "func", None):
            # An argument error like any other: one line (the whole help was printed, exit status 2).
            parser.error(f"a command is required: one of {', '.join(_commands(parser))}")
        prog = f"{parser.prog} {args.command}"
        return run_command(args.func, args, prog, label=getattr(args, "error_label", "error"))
    except KeyboardInterrupt:
        # Ctrl-C while build_parser imported the commands' modules (most of the first half
        # second: numpy, msgspec, ...) or in a command that does not handle it was a traceback.
        return interrupted(prog, exiting=argv is None)


def interrupted(prog: str, *, exiting: bool = False) -> int:
    """After a Ctrl-C: ``PROG: interrupted`` on stderr; returns :data:`INTERRUPTED_STATUS`.
    ``exiting`` (the process ends next): further Ctrl-C are ignored, as one more press before
    the exit was a KeyboardInterrupt traceback."""
    if exiting:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if sys.stderr is not None:  # None: started with stderr closed
            print(f"{prog}: interrupted", file=sys.stderr, flush=True)
    except (KeyboardInterrupt, OSError, ValueError):  # another Ctrl-C, or stderr gone: the status says it
        pass
    return INTERRUPTED_STATUS


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    return [name for a in parser._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices]


#: Longest message line written (an error or a note); a longer one keeps its start and end.
MAX_LINE_CHARS = 2000


def one_line(text: str) -> str:
    """``text`` with control characters (a newline in a file name) escaped: one line, of at most
    :data:`MAX_LINE_CHARS` characters (a value quoted whole, such as a 4 MB YAML tag or path
    from a file, made a line of megabytes); the middle of a longer one is elided, so the line
    still ends with where the problem is."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)
    if len(text) <= MAX_LINE_CHARS:
        return text
    head, tail = MAX_LINE_CHARS * 2 // 3, MAX_LINE_CHARS // 4
    return f"{text[:head]} [... {len(text) - head - tail} characters ...] {text[-tail:]}"


def report_error(prog: str, error: KVSlotsError, label: str | None = "error") -> int:
    """Prints ``PROG: LABEL: MESSAGE`` (``PROG: MESSAGE`` without a label) as one line on
    stderr; returns exit status 2."""
    head = f"{prog}: {label}: " if label else f"{prog}: "
    print(head + one_line(str(error)), file=sys.stderr)
    return 2


def run_command(func: Callable[[argparse.Namespace], int | None], args: argparse.Namespace, prog: str,
                label: str | None = "error") -> int:
    """Runs a command: its status, or 2 after one line on stderr for a KVSlotsError. A
    subcommand's parser may set the default ``error_label`` (``None``: ``kvslots indexer: ...``,
    as that command has always written its errors)."""
    try:
        status = int(func(args) or 0)
        if sys.stdout is not None:  # None: started with stdout closed (>&-); flush() was an AttributeError
            sys.stdout.flush()  # here, not at exit: a closed pipe is then the error below
        return status
    except KVSlotsError as e:
        return report_error(prog, e, label)
    except UnicodeEncodeError as e:
        # stdout's encoding has no such character (PYTHONIOENCODING=ascii, or a C locale with
        # Python's UTF-8 coercion off): a traceback and exit status 1 for a non-ASCII value.
        encoding = getattr(sys.stdout, "encoding", None)
        if encoding is None or codecs.lookup(encoding).name != codecs.lookup(e.encoding).name:
            raise
        head = f"{prog}: {label}: " if label else f"{prog}: "
        print(head + f"cannot write the output: stdout's encoding ({encoding}) has no character "
              f"{e.object[e.start:e.start + 1]!a} (set PYTHONIOENCODING=utf-8)", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in _OUTPUT_ERRNOS:
            raise
        # Writing stdout failed (`| head -1`: a broken pipe; >/dev/full): one line, not a
        # traceback (exit status 1), and stdout pointed at /dev/null so that flushing it at exit
        # does not fail again.
        _stdout_to_devnull()
        head = f"{prog}: {label}: " if label else f"{prog}: "
        print(head + f"cannot write the output: {e.strerror or e}", file=sys.stderr)
        return 2


def _stdout_to_devnull() -> None:
    """Points stdout's descriptor at /dev/null, once writing it failed, so that flushing what is
    left at exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no file descriptor behind sys.stdout, or none
        pass


#: What writing a command's output may fail with: the reader went away, the disk is full, there is
#: no stdout (:func:`output`).
_OUTPUT_ERRNOS = {errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EBADF}


def output() -> Any:
    """``sys.stdout``, for a command whose output is the point. Started with stdout closed
    (``>&-``), Python has none (``None``: writing to it was an AttributeError traceback, and
    ``print`` wrote nothing at all): an OSError that :func:`run_command` reports as one line,
    exit status 2."""
    if sys.stdout is None:
        raise OSError(errno.EBADF, "stdout is closed")
    return sys.stdout


def write_file(path: str, text: str) -> None:
    """Writes ``text`` (UTF-8) to the file ``path`` that a command was asked to write (``-o``);
    a ConfigError naming ``path`` if that fails. The one home for how a command writes a file.

    A regular file (or a new one) is written whole or not at all where it can be replaced: a
    temporary file beside it is filled, flushed to disk, given the old file's mode and renamed
    over it, so a write that fails (a full disk, ``ulimit -f``, a Ctrl-C) or a crash leaves an
    existing file byte-for-byte as it was; a failure or a Ctrl-C (KeyboardInterrupt) leaves no
    temporary file. In the kvslots program itself (:func:`main` run as the program, which calls
    :func:`handle_ending_signals`) neither does a SIGTERM or a SIGHUP: from the first such write
    in the main thread, SIGTERM, SIGHUP and SIGINT, where they end the process by default, have
    a handler that removes it and then ends the process by the signal, for the rest of the
    process. Called from a program that imports kvslots, it changes no signal's handler (that
    is the program's to decide): there a SIGTERM or a SIGHUP part way may leave a hidden
    ``.kvslots-*.tmp`` beside the file, as a SIGKILL may anywhere. A new file gets 0666 less
    the umask. A link is followed (the file it names is replaced, the link kept). Where a
    replace would lose something or cannot be made, the file is written in place (truncated
    first), as before: a file with other hard links, extended attributes (ACLs, labels) or
    another owner we cannot give the new one, in a directory we may not write, or that is a
    mount point. What is not a regular file (a FIFO, ``/dev/null``, ``/dev/stdout``) is written
    in place, as a stream."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: not the path's fault, as the ValueError below says
        raise ConfigError("cannot write: the output is not valid Unicode text (a lone surrogate)", None, path) from None
    st = None
    try:
        try:
            st = os.stat(path)  # the path as given, as open() reads it: "FILE/" is not FILE
        except FileNotFoundError:
            if os.path.basename(path) in ("", ".", ".."):  # "new/": open() made no file "new" of it
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR)) from None
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        target = os.path.realpath(path)
        if st is not None and stat.S_ISREG(st.st_mode):
            # Refused as open() refused it (a file we may not write, a read-only file system):
            # renamed over from a writable directory, such a file was replaced.
            probe: list[int] = []  # _open_into: a Ctrl-C as os.open returned left the descriptor open
            try:
                _open_into(probe, target, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            finally:
                for fd in probe:
                    os.close(fd)
        if _in_place(path, st) or not _replaceable(target, st) or not _write_replacing(target, data, st):
            _write_in_place(path, data)
    except OSError as e:
        if e.errno == errno.ENXIO and st is not None and stat.S_ISFIFO(st.st_mode):
            why = "a FIFO that nobody reads"
        else:
            why = e.strerror or str(e)
        raise ConfigError(f"cannot write: {why}", None, path) from None
    except ValueError:  # a NUL or a lone surrogate in the path (open's ValueError was a traceback)
        why = "a NUL" if "\0" in path else "a lone surrogate, which no file name holds,"
        raise ConfigError(f"cannot write: {why} in the path", None, path) from None


def _in_place(path: str, st: os.stat_result | None) -> bool:
    """Whether ``path`` is written as a stream rather than replaced: anything but a regular file
    (a FIFO such as ``-o >(cmd)``, a device), and a process's own descriptors (``/dev/stdout``
    resolves to the file stdout was opened on: replaced, the shell's descriptor kept the old one;
    on a pipe, to no path at all)."""
    if st is not None and not stat.S_ISREG(st.st_mode):
        return True
    absolute = os.path.abspath(path)
    return absolute in ("/dev/stdout", "/dev/stderr") or absolute.startswith(("/dev/fd/", "/proc/"))


def _replaceable(target: str, st: os.stat_result | None) -> bool:
    """Whether a new file renamed over ``target`` would be the same file to its users: not if
    it has other hard links (they would keep the old text), extended attributes (ACLs, security
    labels: a new file would not have them) or an owner and group we cannot give a new file."""
    if st is None:
        return True
    if st.st_nlink > 1:
        return False
    try:
        if os.listxattr(target):
            return False
    except OSError:  # no extended attributes on this file system
        pass
    return os.geteuid() == 0 or (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid())


def _write_in_place(path: str, data: bytes) -> None:
    # O_NONBLOCK for the open only: a FIFO nobody reads is ENXIO, not a wait without end (it
    # hung); one with a reader (-o >(cmd)) is then written as a blocking pipe.
    fds: list[int] = []
    try:
        _open_into(fds, path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
        os.set_blocking(fds[0], True)
        _write_all(fds[0], data)
    finally:
        for fd in fds:
            os.close(fd)


def _open_into(fds: list[int], path: str, flags: int, mode: int = 0o777) -> None:
    """Appends ``os.open(path, flags, mode)`` to ``fds`` in C, with no Python code between, so
    no signal's handler runs between (a Ctrl-C's KeyboardInterrupt as os.open returned lost
    the descriptor): whoever holds ``fds`` closes it."""
    fds.extend(map(os.open, (path,), (flags,), (mode,)))


#: A temporary file that cannot be made beside the target, or renamed over it: written in place.
_NO_REPLACE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.EBUSY, errno.EXDEV)


def _write_replacing(target: str, data: bytes, st: os.stat_result | None) -> bool:
    """Writes ``data`` to a temporary file beside ``target`` and renames it over it; False,
    with nothing left behind, where the directory takes no new file or the rename cannot be
    made (a directory we may not write, a read-only one, a target that is a mount point)."""
    directory = os.path.dirname(target) or "."
    _remove_on_ending_signals()
    # The temporary file's descriptor, once it exists (_open_into: a KeyboardInterrupt as
    # os.open returned lost the descriptor, and the file was taken for not made and left).
    made: list[int] = []
    tmp = None
    try:
        # A short name of our own (the target's name may already be NAME_MAX long), hidden,
        # in the same directory: os.replace is atomic only within one file system. A new
        # file: 0o666, the umask applies, as to open(path, "w"). Over an existing one: 0o600
        # until it has that file's mode, never more open than the file it replaces.
        flags, mode = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666 if st is None else 0o600
        for _ in range(100):
            tmp = os.path.join(directory, f".kvslots-{os.urandom(6).hex()}.tmp")
            # Noted before it exists, as ours unless os.open says it is another's: a signal that
            # ends the process removes it whenever it comes. Noted and made under _LOCK, which the
            # handler takes for good: no other thread makes a file after its list was read.
            with _LOCK:
                if _ENDING:
                    tmp = None
                    raise OSError(errno.EINTR, "the process is ending")
                _LIVE[tmp] = (os.getpid(), made)
                try:
                    _open_into(made, tmp, flags, mode)
                    break
                except OSError as e:  # not made (a FileExistsError: another's, never removed)
                    del _LIVE[tmp]
                    tmp = None
                    if isinstance(e, FileExistsError):
                        continue
                    if e.errno in _NO_REPLACE:
                        return False
                    raise
        else:  # 100 names of 48 random bits all taken: not a directory to write in
            raise OSError(errno.EEXIST, "no free temporary file name beside it")
        fd = made[0]
        if st is not None:  # the file's own mode and owner (checked replaceable), not ours
            os.fchmod(fd, stat.S_IMODE(st.st_mode))
            if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
                os.fchown(fd, st.st_uid, st.st_gid)
        _write_all(fd, data)
        os.fsync(fd)  # on disk before the rename: a crash then leaves old or new, not an empty file
        made[0] = -1  # closed: marked first, never closed twice (the number may be reused)
        os.close(fd)
        try:
            os.replace(tmp, target)
        except OSError as e:
            if e.errno in _NO_REPLACE:
                _remove_temporary(tmp, made)
                return False
            raise
        del _LIVE[tmp]  # the target's now (a signal just before finds no such name)
    except BaseException:  # an OSError, or a Ctrl-C part way: no temporary file left behind
        if tmp is not None:
            for _ in range(100):
                try:  # again after a second Ctrl-C during it (it skipped the cleanup), as _end_by_signal does
                    _remove_temporary(tmp, made)
                    break
                except KeyboardInterrupt:
                    continue
        raise
    dfd: list[int] = []
    try:  # the rename itself on disk; a directory that cannot be synced still holds the new file
        _open_into(dfd, directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        os.fsync(dfd[0])
    except OSError:
        pass
    finally:
        for fd in dfd:
            os.close(fd)
    return True


def _remove_temporary(tmp: str, made: list[int]) -> None:
    """Closes and removes the temporary file ``tmp`` (a name of ours: made by us, or not yet
    made), then forgets it."""
    if made:
        fd, made[0] = made[0], -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
    try:
        os.unlink(tmp)
    except OSError:
        pass
    _LIVE.pop(tmp, None)  # last: a signal meanwhile still removes it


#: Whether write_file may give the ending signals a handler (:func:`handle_ending_signals`).
_OWNED = False


def handle_ending_signals() -> None:
    """Says that kvslots owns this process (the ``kvslots`` program, ``python -m kvslots``): from
    then on write_file sets the handler of :func:`_remove_on_ending_signals`. Side effect, for the
    rest of the process: SIGTERM, SIGHUP and SIGINT where they had the default action have a
    Python handler, which runs only when the main thread next runs Python code (a long C call
    delays the exit) and which ``signal.getsignal`` returns. Not done by a library call of
    write_file: a program that imports kvslots keeps its signals as they were."""
    global _OWNED
    _OWNED = True


#: Signals that end the process by default, and so would leave write_file's temporary file
#: behind (a kill, a closed terminal, a SIGINT where it is not Python's KeyboardInterrupt).
_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)

#: write_file's temporary files in progress (made, or being made: names of 48 random bits that
#: os.open did not find taken), for :func:`_end_by_signal`; each with the id of the process
#: writing it and a list holding its descriptor once made (-1 once closed).
_LIVE: dict[str, tuple[int, list[int]]] = {}


#: Held while a temporary file is noted and made, and by :func:`_end_by_signal` from its start
#: to the process's end (os.unlink lets other threads run: those that kept making files after
#: it read _LIVE left them). Reentrant: the handler runs in the main thread, which may hold it.
_LOCK = threading.RLock()
#: Set by :func:`_end_by_signal`: no temporary file is made after it.
_ENDING = False


def _forget_after_fork() -> None:
    """In a forked child: the parent's temporary files are the parent's. The child inherits the
    handler and a copy of _LIVE: killed (multiprocessing's terminate), it removed the file the
    parent was still writing, whose write then failed. The lock may have been held by a thread
    the child does not have: a new one."""
    global _LOCK, _ENDING
    _LOCK = threading.RLock()
    _ENDING = False
    _LIVE.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _remove_on_ending_signals() -> None:
    """Makes each of :data:`_ENDING_SIGNALS` whose action is the default (end the process)
    remove write_file's temporary files first (:func:`_end_by_signal`): a kill or a closed
    terminal left a ``.kvslots-*.tmp`` beside the target. The handler stays for the rest of the
    process, and ends it as the default action would: putting the default back after each
    write could lose a signal (CPython: "Signal 15 ignored due to race condition", the
    process kept running). A signal with a handler of the program's own (Python's SIGINT
    handler: a KeyboardInterrupt, which write_file's cleanup handles) or ignored is left as
    it is; its handler decides. Python runs signal handlers only in the main thread, and only
    that thread may set them: until write_file has run there once, a write from another thread
    has no such handler. A SIGKILL still leaves the file. Only in a process kvslots owns
    (:func:`handle_ending_signals`)."""
    if not _OWNED or threading.current_thread() is not threading.main_thread():
        return
    for signum in _ENDING_SIGNALS:
        # Set over the default action, no signal is lost: one that comes before ends the
        # process (no file exists yet), one after runs this handler. A Ctrl-C part way leaves
        # each signal with the default action or this handler, both whole.
        if signal.getsignal(signum) == signal.SIG_DFL:
            signal.signal(signum, _end_by_signal)


def _end_by_signal(signum: int, frame: Any) -> None:
    """Removes the temporary files that exist, then ends the process by ``signum`` (the
    default action, the signal let through: the exit status is the signal's)."""
    global _ENDING
    for _ in range(100):
        try:  # again after another signal's handler raised here (a Ctrl-C): this one still ends it
            _LOCK.acquire()  # never released: the process ends holding it (waits for a thread's os.open)
            _ENDING = True
            pid = os.getpid()  # and only this process's (a fork from C code keeps the parent's entries)
            for path, (owner, _) in list(_LIVE.items()):
                if owner == pid:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
            signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, (signum,))
            signal.raise_signal(signum)
        except BaseException:
            continue
    os._exit(128 + signum)  # not ended by the default action (cannot happen for these signals)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


if __name__ == "__main__":
    sys.exit(main())
