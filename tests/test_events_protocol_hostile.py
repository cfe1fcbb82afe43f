"""The framing helpers of :mod:`kvslots.events.protocol` given what no socket gives them: frames
that are no list of bytes, and sequence numbers, topics and payloads of the wrong type or range.
Each raised a builtin error (TypeError, AttributeError, OverflowError, or whatever a bytes
subclass's own ``__len__`` / ``__eq__`` raised); now a kvslots error naming the argument. A
peer's malformed message (the right types, the wrong shape) is still a None."""

from __future__ import annotations

import pytest

from kvslots.errors import ArgumentTypeError, InvalidArgumentError, KVSlotsError
from kvslots.events import protocol as P

SEQ = (7).to_bytes(8, "big")


class _Raising(bytes):
    def __len__(self):
        raise RuntimeError("len")

    def __eq__(self, other):
        raise RuntimeError("eq")

    __hash__ = bytes.__hash__


BAD_FRAMES = [None, 1, float("nan"), b"abc", "abc", {b"a": b"b"}, iter([b"", b"", SEQ]), [None, None, None],
              ["", "", ""], [b"", b"", SEQ, 5], [bytearray(b""), b"", SEQ], [_Raising(b"t"), _Raising(SEQ), b"p"],
              (b"", _Raising(b""), SEQ, b"p")]


@pytest.mark.parametrize("frames", BAD_FRAMES, ids=range(len(BAD_FRAMES)))
@pytest.mark.parametrize("parse", [P.parse_live, P.parse_replay_request, P.parse_replay_reply])
def test_frames_that_are_no_list_of_bytes_are_an_argument_type_error(parse, frames):
    with pytest.raises(ArgumentTypeError, match="frames must be a list of bytes"):
        parse(frames)


def test_malformed_messages_of_bytes_are_still_none_and_good_ones_parse():
    assert P.parse_live([b"t", SEQ]) is None
    assert P.parse_live((b"t", b"\x00", b"p")) is None
    assert P.parse_live((b"t", SEQ, b"p")) == (7, b"p")
    assert P.parse_replay_request([b"c", b"x", SEQ]) is None
    assert P.parse_replay_request((b"c", b"", SEQ)) == (b"c", 7)
    assert P.parse_replay_reply([]) is None
    assert P.parse_replay_reply((b"", b"t", SEQ, b"p"), b"t") == (7, b"p")


BAD_SEQS = [(None, ArgumentTypeError), ("1", ArgumentTypeError), (1.0, ArgumentTypeError), (True, ArgumentTypeError),
            (-1, InvalidArgumentError), (2**64, InvalidArgumentError), (2**70, InvalidArgumentError)]


@pytest.mark.parametrize(("seq", "error"), BAD_SEQS, ids=[repr(s) for s, _ in BAD_SEQS])
def test_a_bad_sequence_number_to_send_is_a_kvslots_error(seq, error):
    with pytest.raises(error, match="seq"):
        P.live_message(b"t", seq, b"p")
    with pytest.raises(error, match="seq"):
        P.replay_reply(b"c", b"t", seq, b"p")


@pytest.mark.parametrize("bad", [None, "t", 5, [b"t"]], ids=repr)
def test_frames_to_send_must_be_bytes(bad):
    for call, name in ((lambda: P.live_message(bad, 1, b"p"), "topic"), (lambda: P.live_message(b"t", 1, bad), "payload"),
                       (lambda: P.replay_reply(bad, b"t", 1, b"p"), "client"),
                       (lambda: P.replay_reply(b"c", bad, 1, b"p"), "topic"),
                       (lambda: P.replay_reply(b"c", b"t", 1, bad), "payload"), (lambda: P.replay_end(bad), "client")):
        with pytest.raises(ArgumentTypeError, match=f"{name} must be bytes,"):
            call()


def test_good_frames_to_send_are_as_before():
    assert P.live_message(b"t", 2**64 - 1, b"p") == (b"t", b"\xff" * 8, b"p")
    assert P.replay_reply(b"c", b"t", 0, b"p") == (b"c", b"", b"t", bytes(8), b"p")
    assert P.replay_end(b"c") == (b"c", b"", b"", P.END_SEQ, b"")
    assert P.live_message(bytearray(b"t"), 1, memoryview(b"p"))[0] == bytearray(b"t")  # ZMQ sends these too
    assert P.parse_replay_reply(list(P.replay_end(b"c")[1:])) == (P.REPLAY_END, b"")
    assert issubclass(ArgumentTypeError, KVSlotsError)
