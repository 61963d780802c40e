"""The pipe protocol's framing (pgjobd/protocol.py, pgjobd/channel.py), property-tested.

Frames travel over real anyio streams: memory object streams of byte chunks, where the
test chooses every chunk boundary, and real os.pipe pairs between a parent Channel and
a ChildChannel in this process. Nothing of the code under test is replaced.
"""

from __future__ import annotations

import itertools
import os
import struct
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC
from typing import Any

import anyio
import msgspec
import pytest
from anyio.streams.file import FileReadStream, FileWriteStream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pgjobd.channel import Channel
from pgjobd.model import ClaimedJob, KindInfo
from pgjobd.protocol import (
    HEADER,
    MAX_FRAME,
    BootFailed,
    Cancel,
    ChildChannel,
    Decoder,
    Done,
    Message,
    ProtocolError,
    Ready,
    Results,
    ResultsWanted,
    Run,
    Stop,
    ToChild,
    ToParent,
    encode_frame,
    frame_length,
)

pytestmark = pytest.mark.anyio

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- strategies: every message type, with edge values ------------------------------------

text = st.text(st.characters(codec="utf-8"), max_size=40)
int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
floats = st.floats(allow_nan=False)
moments = st.datetimes(timezones=st.just(UTC))

claimed_jobs = st.builds(
    ClaimedJob, id=int64, fence=int64, kind=text, queue=text, attempt=int32,
    max_attempts=int32, crashes=int32, priority=int32, tenant=st.none() | text,
    enqueued_at=moments, scheduled_at=moments, args=st.binary(max_size=200),
    depends_on=st.lists(int64, max_size=5).map(tuple), after=st.lists(int64, max_size=5).map(tuple),
    after_failed=int32,
)  # fmt: skip
kind_infos = st.builds(
    KindInfo, kind=text, queue=st.none() | text, priority=st.none() | int32,
    max_attempts=st.none() | int32, timeout_s=st.none() | floats,
)  # fmt: skip
verdicts = st.sampled_from(
    ["completed", "failed", "retry", "snoozed", "discarded", "invalid_args",
     "unknown_kind", "crashed", "given_back"]
)  # fmt: skip

to_child: st.SearchStrategy[Message] = st.one_of(
    st.builds(Run, job=claimed_jobs, timeout_s=floats),
    st.builds(Cancel, job_id=int64, fence=int64),
    st.builds(Stop),
    st.builds(
        Results,
        job_id=int64,
        fence=int64,
        results=st.none() | st.binary(max_size=200),
        error=st.none() | text,
    ),
)
to_parent: st.SearchStrategy[Message] = st.one_of(
    st.builds(Ready, pid=int32, kinds=st.lists(kind_infos, max_size=4)),
    st.builds(BootFailed, message=text),
    st.builds(
        Done,
        job_id=int64,
        fence=int64,
        verdict=verdicts,
        duration_s=floats,
        result=st.none() | st.binary(max_size=200),
        error_class=st.none() | text,
        error_message=st.none() | text,
        traceback=st.none() | text,
        after_s=st.none() | floats,
        fingerprint=st.none() | text,
    ),
    st.builds(ResultsWanted, job_id=int64, fence=int64),
)


def split(data: bytes, cuts: Sequence[int]) -> list[bytes]:
    """`data` in chunks, cut at the given offsets (taken modulo its length)."""
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


@asynccontextmanager
async def fed_channel(
    chunks: Sequence[bytes], incoming: Any = ToParent, *, close: bool = True
) -> AsyncIterator[Channel[Any]]:
    """A parent channel whose input is exactly these chunks, then the end of input
    (unless `close` is false: then the input stays open, with nothing more to come)."""
    into, source = anyio.create_memory_object_stream[bytes](len(chunks) + 1)
    out, sink = anyio.create_memory_object_stream[bytes](100)
    for chunk in chunks:
        into.send_nowait(chunk)
    if close:
        into.close()
    channel: Channel[Any] = Channel(out, source, incoming)  # type: ignore[arg-type]
    try:
        yield channel
    finally:
        into.close()
        sink.close()
        await channel.aclose()


async def receive_all(channel: Channel[Any]) -> list[Any]:
    """Every message until the end of input (EndOfStream), with a generous bound."""
    messages = []
    with anyio.fail_after(30):
        while True:
            try:
                messages.append(await channel.receive())
            except anyio.EndOfStream:
                return messages


# -- round trips, whatever the chunking --------------------------------------------------


@SETTINGS
@given(messages=st.lists(to_parent, max_size=8), cuts=st.lists(st.integers(0, 10**6)))
async def test_messages_to_the_parent_round_trip_whatever_the_read_boundaries(
    messages: list[Message], cuts: list[int]
) -> None:
    stream = b"".join(encode_frame(m) for m in messages)
    async with fed_channel(split(stream, cuts), ToParent) as channel:
        assert await receive_all(channel) == messages


@SETTINGS
@given(messages=st.lists(to_child, max_size=8), cuts=st.lists(st.integers(0, 10**6)))
async def test_messages_to_the_child_round_trip_whatever_the_read_boundaries(
    messages: list[Message], cuts: list[int]
) -> None:
    stream = b"".join(encode_frame(m) for m in messages)
    async with fed_channel(split(stream, cuts), ToChild) as channel:
        assert await receive_all(channel) == messages


@SETTINGS
@given(messages=st.lists(to_child | to_parent, min_size=1, max_size=8))
async def test_send_many_writes_one_chunk_of_whole_frames(messages: list[Message]) -> None:
    out, sink = anyio.create_memory_object_stream[bytes](10)
    into, source = anyio.create_memory_object_stream[bytes](10)
    channel: Channel[Any] = Channel(out, source, ToParent)  # type: ignore[arg-type]
    async with sink, into:
        await channel.send_many(messages)
        (written,) = [sink.receive_nowait()]
        with pytest.raises(anyio.WouldBlock):
            sink.receive_nowait()
        assert written == b"".join(encode_frame(m) for m in messages)
        await channel.aclose()


def test_every_message_type_is_covered_by_the_strategies() -> None:
    # A message type added to protocol.py must be added to the strategies above.
    def types(union: Any) -> set[type]:
        return set(getattr(union, "__args__", (union,)))

    assert types(ToChild) == {Run, Cancel, Stop, Results}
    assert types(ToParent) == {Ready, BootFailed, Done, ResultsWanted}
    assert set(Message.__subclasses__()) == types(ToChild) | types(ToParent)


# -- the frame size limit ----------------------------------------------------------------


def test_frame_length_accepts_max_frame_and_refuses_one_byte_more() -> None:
    assert frame_length(HEADER.pack(0)) == 0
    assert frame_length(HEADER.pack(MAX_FRAME)) == MAX_FRAME
    with pytest.raises(ProtocolError, match=f"over the {MAX_FRAME} limit"):
        frame_length(HEADER.pack(MAX_FRAME + 1))
    with pytest.raises(ProtocolError):
        frame_length(HEADER.pack(2**32 - 1))


def _done_of_body_size(size: int) -> Done:
    """A Done whose msgpack body is exactly `size` bytes."""
    probe = Done(job_id=1, fence=1, verdict="completed", duration_s=0.0, result=b"")
    overhead = len(msgspec.msgpack.encode(probe))
    # bin 32 carries a 4-byte length instead of bin 8's one byte: 3 more.
    message = Done(job_id=1, fence=1, verdict="completed", duration_s=0.0,
                   result=b"x" * (size - overhead - 3))  # fmt: skip
    assert len(msgspec.msgpack.encode(message)) == size
    return message


@pytest.mark.slow
async def test_a_frame_of_exactly_max_frame_travels_and_one_byte_more_is_refused() -> None:
    at_limit = _done_of_body_size(MAX_FRAME)
    frame = encode_frame(at_limit)
    assert len(frame) == HEADER.size + MAX_FRAME
    async with fed_channel(split(frame, range(0, len(frame), 65536))) as channel:
        assert await receive_all(channel) == [at_limit]

    with pytest.raises(ProtocolError, match="Done frame of 16777217 bytes is too big"):
        encode_frame(_done_of_body_size(MAX_FRAME + 1))


@SETTINGS
@given(length=st.integers(MAX_FRAME + 1, 2**32 - 1), cut=st.integers(0, 3))
async def test_an_oversized_header_is_refused_without_waiting_for_its_body(
    length: int, cut: int
) -> None:
    # The input stays open: a reader that believed the header would wait for the body.
    header = HEADER.pack(length)
    async with fed_channel(split(header, [cut]), close=False) as channel:
        with anyio.fail_after(10), pytest.raises(ProtocolError, match="announced"):
            await channel.receive()


# -- truncated input ---------------------------------------------------------------------


async def test_an_empty_input_is_a_clean_end() -> None:
    async with fed_channel([]) as channel:
        with pytest.raises(anyio.EndOfStream):
            await channel.receive()


@SETTINGS
@given(messages=st.lists(to_parent, min_size=1, max_size=4), data=st.data())
async def test_input_ending_inside_a_frame_is_a_protocol_error(
    messages: list[Message], data: st.DataObject
) -> None:
    frames = [encode_frame(m) for m in messages]
    stream = b"".join(frames)
    boundaries = {sum(len(f) for f in frames[:i]) for i in range(len(frames) + 1)}
    end = data.draw(st.integers(1, len(stream) - 1).filter(lambda n: n not in boundaries))
    cuts = data.draw(st.lists(st.integers(0, end)))
    whole = max(b for b in boundaries if b < end)
    complete = sum(1 for b in boundaries if 0 < b <= whole)
    async with fed_channel(split(stream[:end], cuts)) as channel:
        for message in messages[:complete]:
            assert await channel.receive() == message
        inside = "frame header" if end - whole < HEADER.size else "frame of"
        with anyio.fail_after(10), pytest.raises(ProtocolError, match=f"inside a {inside}") as e:
            await channel.receive()
        assert e.value.__context__ is None  # the error alone, not one raised while handling


# -- garbage -----------------------------------------------------------------------------


@SETTINGS
@given(message=to_child)
async def test_a_message_for_the_other_direction_is_a_protocol_error(message: Message) -> None:
    async with fed_channel([encode_frame(message)], ToParent) as channel:
        with pytest.raises(ProtocolError, match="undecodable frame"):
            await channel.receive()


UNDECODABLE_BODIES = [
    b"",  # an empty body: no msgpack object at all
    b"\xc1",  # a byte msgpack never uses
    msgspec.msgpack.encode({"t": "nope"}),  # an unknown tag
    msgspec.msgpack.encode({"job_id": 1}),  # no tag
    msgspec.msgpack.encode({"t": "boot_failed"}),  # a required field missing
    msgspec.msgpack.encode({"t": "boot_failed", "message": 7}),  # a field of the wrong type
    msgspec.msgpack.encode({"t": "done", "job_id": 1, "fence": 1, "kind": "exploded",
                            "duration_s": 0.0}),  # a verdict that does not exist
    msgspec.msgpack.encode([1, 2, 3]),
    encode_frame(Stop())[HEADER.size :] + b"\x00",  # trailing bytes after the message
]  # fmt: skip


@pytest.mark.parametrize("body", UNDECODABLE_BODIES)
async def test_an_undecodable_frame_is_a_protocol_error(body: bytes) -> None:
    frame = HEADER.pack(len(body)) + body
    async with fed_channel([frame]) as channel:
        with pytest.raises(ProtocolError, match="undecodable frame"):
            await channel.receive()
    with pytest.raises(ProtocolError, match="undecodable frame"):
        Decoder(ToParent).decode(body)


@SETTINGS
@given(stream=st.binary(max_size=300), cuts=st.lists(st.integers(0, 300)))
async def test_arbitrary_bytes_end_in_messages_then_end_of_stream_or_protocol_error(
    stream: bytes, cuts: list[int]
) -> None:
    async with fed_channel(split(stream, cuts)) as channel:
        with anyio.fail_after(10):
            while True:
                try:
                    message = await channel.receive()
                except (anyio.EndOfStream, ProtocolError):
                    break
                assert isinstance(message, Ready | BootFailed | Done)


# -- over real pipes: the parent's Channel and the child's ChildChannel ------------------


@asynccontextmanager
async def pipe_pair() -> AsyncIterator[tuple[Channel[ToParent], ChildChannel]]:
    """A parent channel and a child channel joined by two real pipes."""
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    child = await ChildChannel.open(to_child_r, to_parent_w)
    parent: Channel[ToParent] = Channel(
        FileWriteStream(os.fdopen(to_child_w, "wb", buffering=0)),
        FileReadStream(os.fdopen(to_parent_r, "rb", buffering=0)),
        ToParent,
    )
    try:
        yield parent, child
    finally:
        child.close()
        await parent.aclose()


@SETTINGS
@given(
    down=st.lists(to_child, max_size=6),
    up=st.lists(to_parent, max_size=6),
    padding=st.sampled_from([0, 70_000, 300_000]),  # frames bigger than a pipe's buffer
)
async def test_both_ends_over_real_pipes(
    down: list[Message], up: list[Message], padding: int
) -> None:
    big_up = [*up, BootFailed("x" * padding)]
    big_down = [*down, Cancel(job_id=padding, fence=0)]
    async with pipe_pair() as (parent, child):
        async with anyio.create_task_group() as tg:
            tg.start_soon(parent.send_many, big_down)
            with anyio.fail_after(30):
                assert [await child.receive() for _ in big_down] == big_down
        async with anyio.create_task_group() as tg:

            async def send_up() -> None:
                for message in big_up:
                    await child.send(message)

            tg.start_soon(send_up)
            with anyio.fail_after(30):
                assert [await parent.receive() for _ in big_up] == big_up


async def test_concurrent_senders_over_a_real_pipe_never_interleave_frames() -> None:
    senders, each = 8, 25
    async with pipe_pair() as (parent, child):
        received: list[ToChild] = []

        async def send(sender: int) -> None:
            for n in range(each):
                await parent.send_many([Cancel(job_id=sender, fence=n)] * 3)
                await parent.send(Cancel(job_id=sender, fence=-n))

        async with anyio.create_task_group() as tg:
            for sender in range(senders):
                tg.start_soon(send, sender)
            with anyio.fail_after(60):
                while len(received) < senders * each * 4:
                    received.append(await child.receive())
    for sender in range(senders):
        fences = [m.fence for m in received if isinstance(m, Cancel) and m.job_id == sender]
        assert fences == [f for n in range(each) for f in (n, n, n, -n)]


async def test_child_end_of_input_is_eof_between_frames_and_protocol_error_inside() -> None:
    for tail, expected in [(b"", EOFError), (b"\x00\x00", ProtocolError),
                           (HEADER.pack(10) + b"abc", ProtocolError)]:  # fmt: skip
        read_fd, write_fd = os.pipe()
        other_r, other_w = os.pipe()
        child = await ChildChannel.open(read_fd, other_w)
        try:
            os.write(write_fd, encode_frame(Stop()) + tail)
            os.close(write_fd)
            with anyio.fail_after(10):
                assert await child.receive() == Stop()
                with pytest.raises(expected):
                    await child.receive()
        finally:
            child.close()
            os.close(other_r)


async def test_child_refuses_an_oversized_header_without_waiting_for_its_body() -> None:
    read_fd, write_fd = os.pipe()
    other_r, other_w = os.pipe()
    child = await ChildChannel.open(read_fd, other_w)
    try:
        os.write(write_fd, struct.pack(">I", MAX_FRAME + 1))  # the pipe stays open
        with anyio.fail_after(10), pytest.raises(ProtocolError, match="announced"):
            await child.receive()
    finally:
        child.close()
        os.close(write_fd)
        os.close(other_r)


async def test_parent_send_to_a_closed_pipe_is_broken_resource() -> None:
    read_fd, write_fd = os.pipe()
    _, source = anyio.create_memory_object_stream[bytes](1)
    parent: Channel[ToParent] = Channel(
        FileWriteStream(os.fdopen(write_fd, "wb", buffering=0)),
        source,
        ToParent,  # type: ignore[arg-type]
    )
    os.close(read_fd)  # the child is gone
    try:
        with anyio.fail_after(10), pytest.raises(anyio.BrokenResourceError):
            await parent.send(Stop())
    finally:
        await parent.aclose()


async def test_child_send_to_a_closed_pipe_calls_on_broken() -> None:
    to_child_r, to_child_w = os.pipe()
    to_parent_r, to_parent_w = os.pipe()
    child = await ChildChannel.open(to_child_r, to_parent_w)
    broken = anyio.Event()
    child.on_broken = broken.set
    os.close(to_parent_r)  # the parent is gone
    try:
        with anyio.fail_after(10):
            while not broken.is_set():
                await child.send(BootFailed("nobody reads this"))
                await anyio.sleep(0.01)
    finally:
        child.close()
        os.close(to_child_w)


def test_a_done_keeps_its_wire_name_across_the_verdict_rename() -> None:
    """A worker of the release before the rename (or after it) still understands the
    other side: the verdict travels under its old key, "kind"."""
    body = msgspec.msgpack.encode(Done(job_id=1, fence=2, verdict="failed", duration_s=0.5))
    assert msgspec.msgpack.decode(body)["kind"] == "failed"
    old = {"t": "done", "job_id": 1, "fence": 2, "kind": "snoozed", "duration_s": 0.0}
    decoded = Decoder(ToParent).decode(msgspec.msgpack.encode(old))
    assert isinstance(decoded, Done) and decoded.verdict == "snoozed"
