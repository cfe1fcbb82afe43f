"""The subscriber's sequencing logic against a model publisher: live messages dropped at random,
replays served late, interleaved with the live stream in any order, and missing replies (a
ROUTER past its high-water mark drops them, end marker included). No sockets: frames go straight
into the handlers, so hypothesis can explore the orderings."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvslots.events import KVEventBatch, encode_batch
from kvslots.events.protocol import END_SEQ
from kvslots.events.subscriber import EventSubscriber, _Peer


class FakeDealer:
    def __init__(self) -> None:
        self.requests: list[int] = []

    def send_multipart(self, frames, flags=0) -> None:
        assert frames[0] == b""
        self.requests.append(int.from_bytes(frames[1], "big"))

    def close(self, linger=None) -> None:
        pass


class ModelPublisher:
    def __init__(self, buffer_steps: int) -> None:
        self.published = 0
        self.buffer_steps = buffer_steps
        self.payloads: list[bytes] = []

    def publish(self) -> int:
        seq = self.published
        self.payloads.append(encode_batch(KVEventBatch(float(seq), [])))
        self.published += 1
        return seq

    def replay(self, start: int) -> list[list[bytes]]:
        first = max(0, self.published - self.buffer_steps)
        out = [
            [b"", b"", s.to_bytes(8, "big"), self.payloads[s]]
            for s in range(max(start, first), self.published)
        ]
        return out + [[b"", b"", END_SEQ, b""]]


actions = st.lists(
    st.one_of(
        st.tuples(st.just("publish"), st.booleans()),  # (deliver live?)
        st.tuples(st.just("live"), st.integers(1, 4)),
        st.tuples(st.just("serve"), st.just(0)),
        st.tuples(st.just("replay"), st.integers(1, 4)),
        st.tuples(st.just("drop_reply"), st.integers(0, 50)),
    ),
    max_size=120,
)


class Model:
    """One subscriber peer wired to a model publisher; ``run`` plays a script, then drains,
    timing out a replay that has nothing more coming."""

    def __init__(self, sub: EventSubscriber, buffer_steps: int, from_zero: bool) -> None:
        self.sub = sub
        self.peer = _Peer("w", "tcp://model:1", "tcp://model:2", b"", 0 if from_zero else None)
        self.dealer = FakeDealer()
        self.peer.dealer = self.dealer  # type: ignore[assignment]
        sub._new_dealer = self.new_dealer  # type: ignore[method-assign]
        sub._peers[id(self.peer)] = sub._by_id["w"] = self.peer
        self.pub = ModelPublisher(buffer_steps)
        self.live: list[list[bytes]] = []
        self.replay: list[tuple[list[bytes], int]] = []  # (frames, place in its reply)
        self.served = 0
        self.seen: set[int] = set()
        if from_zero:
            self.peer.next = 0
            self.peer.fresh = True
            sub._request_replay(self.peer)

    def new_dealer(self, peer: _Peer) -> None:
        """A fresh socket: replies to the old one never arrive."""
        self.replay.clear()
        self.served = len(self.dealer.requests)

    def step(self, kind: str, arg) -> None:
        if kind == "publish":
            seq = self.pub.publish()
            if arg:
                self.live.append([b"", seq.to_bytes(8, "big"), self.pub.payloads[seq]])
        elif kind == "live":
            for _ in range(min(arg, len(self.live))):
                frames = self.live.pop(0)
                self.seen.add(int.from_bytes(frames[1], "big"))
                self.sub._on_live_frames(self.peer, frames)
        elif kind == "serve":
            if self.served < len(self.dealer.requests):
                reply = self.pub.replay(self.dealer.requests[self.served])
                self.replay.extend((frames, i) for i, frames in enumerate(reply))
                self.served += 1
        elif kind == "drop_reply":
            # Anything but the first message of a reply: a ROUTER drops only past its
            # high-water mark, which the start of a reply does not reach.
            if self.replay:
                i = arg % len(self.replay)
                if self.replay[i][1] > 0:
                    del self.replay[i]
        else:
            for _ in range(min(arg, len(self.replay))):
                frames, _ = self.replay.pop(0)
                if frames[2] != END_SEQ:
                    self.seen.add(int.from_bytes(frames[2], "big"))
                self.sub._on_replay_frames(self.peer, frames)

    def run(self, script) -> None:
        for kind, arg in script:
            self.step(kind, arg)
        while True:
            while self.live or self.replay or self.served < len(self.dealer.requests):
                self.step("serve", 0)
                self.step("replay", 10**9)
                self.step("live", 10**9)
            if not self.peer.replaying:
                break
            self.sub._replay_timed_out(self.peer)  # nothing more is coming


@settings(max_examples=400, deadline=None)
@given(actions, st.integers(1, 40), st.booleans())
def test_ordered_exactly_once_under_drops_and_interleavings(script, buffer_steps, from_zero):
    applied: list[int] = []
    sub = EventSubscriber(lambda w, s, b: applied.append(s))
    m = Model(sub, buffer_steps, from_zero)
    m.run(script)
    peer, pub, seen = m.peer, m.pub, m.seen

    c = sub.counters
    assert applied == sorted(set(applied)), "in order, each once"
    assert c["resets"] == 0 and c["malformed"] == 0 and c["replay_failures"] == 0
    assert not peer.replaying and not peer.held
    if applied:
        first = 0 if from_zero else applied[0]
        # Every number up to the last applied was applied or reported lost.
        assert len(applied) + c["lost"] == applied[-1] + 1 - first
        if buffer_steps >= pub.published:
            assert c["lost"] == 0 and applied == list(range(first, applied[-1] + 1))
    # With nothing evicted, every batch that reached the subscriber, live or by replay, and
    # everything before it (from where the stream starts) is applied.
    if seen and buffer_steps >= pub.published:
        start = 0 if from_zero else applied[0]
        assert applied == list(range(start, max(seen) + 1))
    sub.stop()


# Scripts that lose batches for good: more publishing, more drops, small replay buffers.
lossy_actions = st.lists(
    st.one_of(
        st.tuples(st.just("publish"), st.booleans()),
        st.tuples(st.just("publish"), st.just(False)),
        st.tuples(st.just("publish"), st.booleans()),
        st.tuples(st.just("live"), st.integers(1, 4)),
        st.tuples(st.just("serve"), st.just(0)),
        st.tuples(st.just("replay"), st.integers(1, 4)),
        st.tuples(st.just("drop_reply"), st.integers(0, 50)),
    ),
    min_size=10,
    max_size=120,
)


@settings(max_examples=400, deadline=None)
@given(lossy_actions, st.integers(1, 8), st.booleans())
def test_resync_on_loss_never_keeps_a_hole(script, buffer_steps, from_zero):
    """With resync_on_loss (the indexer's mode), what the consumer holds between two resets is
    a run of consecutive batches: a batch that cannot be had resets the stream instead of
    being skipped, and the stream is rebuilt from the publisher's buffer."""
    epochs: list[list[int]] = [[]]
    sub = EventSubscriber(lambda w, s, b: epochs[-1].append(s),
                          lambda w, last, new: epochs.append([]), resync_on_loss=True)
    m = Model(sub, buffer_steps, from_zero)
    m.run(script)
    c = sub.counters
    for run in filter(None, epochs):
        assert run == list(range(run[0], run[0] + len(run))), epochs
    assert len(epochs) == 1 + c["resets"] and c["resets"] == c["resyncs"]
    assert c["malformed"] == 0 and not m.peer.replaying and not m.peer.held
    if buffer_steps >= m.pub.published:
        assert c["resets"] == 0 and c["lost"] == 0
    if m.seen:  # the stream is applied up to the last batch that reached the subscriber
        assert epochs[-1] and epochs[-1][-1] == max(m.seen), epochs
    sub.stop()
