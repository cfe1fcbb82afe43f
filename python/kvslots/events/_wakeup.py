"""A self-pipe that wakes a thread blocked in ``zmq.Poller.poll`` from any other thread. ZMQ
sockets are not thread-safe, so the publisher and the subscriber each keep theirs on one thread
and are told about new work through this."""

from __future__ import annotations

import os


class WakePipe:
    """Register :meth:`fileno` with a ``zmq.Poller``; :meth:`wake` from any thread,
    :meth:`drain` on the polling thread when the fd is ready."""

    __slots__ = ("_r", "_w")

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def fileno(self) -> int:
        return self._r

    def wake(self) -> None:
        try:
            os.write(self._w, b"\0")
        except OSError:
            pass  # pipe full: the thread is already due to wake (or the pipe is closed)

    def drain(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except OSError:  # BlockingIOError: empty
            pass

    def close(self) -> None:
        """Idempotent."""
        for fd in (self._r, self._w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._r = self._w = -1
