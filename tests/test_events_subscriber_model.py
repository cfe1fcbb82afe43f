"""The subscriber's sequencing logic against a model publisher: live messages dropped at random,
replays served late and interleaved with the live stream in any order. No sockets: frames go
straight into the handlers, so hypothesis can explore the orderings."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvslots.events import KVEventBatch, encode_batch
from kvslots.events.publisher import END_SEQ
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
    ),
    max_size=120,
)


@settings(max_examples=400, deadline=None)
@given(actions, st.integers(1, 40), st.booleans())
def test_ordered_exactly_once_under_drops_and_interleavings(script, buffer_steps, from_zero):
    applied: list[int] = []
    sub = EventSubscriber(lambda w, s, b: applied.append(s))
    peer = _Peer("w", "tcp://model:1", "tcp://model:2", b"", 0 if from_zero else None)
    dealer = FakeDealer()
    peer.dealer = dealer  # type: ignore[assignment]
    sub._peers["w"] = sub._by_id["w"] = peer
    if from_zero:
        peer.next = 0
        sub._request_replay(peer)

    pub = ModelPublisher(buffer_steps)
    live: list[list[bytes]] = []
    replay: list[list[bytes]] = []
    served = 0
    seen: set[int] = set()

    def step(kind: str, arg) -> None:
        nonlocal served
        if kind == "publish":
            seq = pub.publish()
            if arg:
                live.append([b"", seq.to_bytes(8, "big"), pub.payloads[seq]])
        elif kind == "live":
            for _ in range(min(arg, len(live))):
                frames = live.pop(0)
                seen.add(int.from_bytes(frames[1], "big"))
                sub._on_live_frames(peer, frames)
        elif kind == "serve":
            if served < len(dealer.requests):
                replay.extend(pub.replay(dealer.requests[served]))
                served += 1
        else:
            for _ in range(min(arg, len(replay))):
                frames = replay.pop(0)
                if frames[2] != END_SEQ:
                    seen.add(int.from_bytes(frames[2], "big"))
                sub._on_replay_frames(peer, frames)

    for kind, arg in script:
        step(kind, arg)
    while live or replay or served < len(dealer.requests):
        step("serve", 0)
        step("replay", 10**9)
        step("live", 10**9)

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
