"""A self-pipe that wakes a thread blocked in ``zmq.Poller.poll`` from any other thread. ZMQ
sockets are not thread-safe, so the publisher and the subscriber each keep theirs on one thread
and are told about new work through this."""

from __future__ import annotations

import os
import threading

from ..errors import NoCopy


class WakePipe(NoCopy):
    """Register :meth:`fileno` with a ``zmq.Poller``; :meth:`wake` from any thread,
    :meth:`drain` on the polling thread when the fd is ready."""

    __slots__ = ("_r", "_w", "_lock")
    _copy_refusal = "it owns a pipe's two file descriptors"

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        # wake() and close() run on different threads (a publish() racing a shutdown, the loop
        # thread closing as it ends): without it a wake() between close()'s os.close and its
        # "= -1" wrote into whatever the OS had just given that descriptor number to.
        self._lock = threading.Lock()

    def fileno(self) -> int:
        return self._r

    def wake(self) -> None:
        with self._lock:
            if self._w < 0:
                return  # closed
            try:
                os.write(self._w, b"\0")
            except OSError:
                pass  # pipe full: the thread is already due to wake

    def drain(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except OSError:  # BlockingIOError: empty
            pass

    def close(self) -> None:
        """Idempotent."""
        with self._lock:  # no wake() is writing now, and none will
            fds = (self._r, self._w)
            self._r = self._w = -1
        for fd in fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
