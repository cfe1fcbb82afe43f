"""The extension's locks in a forked child (vLLM, gunicorn --preload and multiprocessing fork
while other threads run)."""

import threading
import time

from kvslots import _core
from process_support import in_child



def test_a_prefix_index_locked_by_another_thread_at_fork_is_refused_in_the_child():
    """PrefixIndex applies events without the GIL, holding its lock: a fork() meanwhile gave
    the child the lock held by a thread it does not have, and the child's next call (len())
    waited for ever. Now InvalidStateError (after 50 ms); the parent is unaffected, and a child
    forked while the lock is free uses its copy as before."""
    # The fork must land while the apply holds the lock: a bigger batch where a fast machine
    # finished it before the fork, rather than a fixed sleep that fails there.
    for n in (1_000_000, 4_000_000, 16_000_000):
        payload = _core.encode_event_batch([("BlockStored", list(range(1, n + 1)), None, [7] * (n * 4), 4, None)], 0.0)
        ix = _core.PrefixIndex()
        ix.add_worker("w")
        started = threading.Event()

        def apply():
            started.set()
            ix.apply("w", payload)

        t = threading.Thread(target=apply)
        t.start()
        started.wait()
        time.sleep(0.1)  # the arguments are read at once; the rest of the apply holds the lock
        if t.is_alive():
            break
        t.join()
    else:
        raise AssertionError("the apply of 16M blocks ended within 0.1 s: no fork could land inside it")
    out = in_child(lambda: len(ix))
    t.join()
    assert out[0] == "InvalidStateError" and "forked" in out[1], out
    assert len(ix) == n
    assert in_child(lambda: [len(ix), ix.worker_len("w")]) == [n, n]
