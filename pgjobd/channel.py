"""The parent's end of a worker's pipes: framed sends and receives on anyio streams.

The messages and their framing are pgjobd.protocol's; this module is the supervisor's
side only, so a worker process never imports anyio.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import anyio
from anyio.abc import ByteReceiveStream, ByteSendStream

from pgjobd.protocol import Decoder, FrameBuffer, Message, encode_frame

M = TypeVar("M")


class Channel(Generic[M]):
    """The parent's end of a pipe pair: framed sends and receives over anyio byte streams.

    Sends are serialized by a lock, so tasks may share a channel. `receive` raises
    anyio.EndOfStream at a clean end of input (between frames) and ProtocolError at a
    truncated or bad frame. Input is read in whole chunks (pgjobd.protocol.FrameBuffer:
    a worker reports the jobs that ended in one turn of its loop in one write).
    """

    def __init__(self, send: ByteSendStream, receive: ByteReceiveStream, incoming: Any) -> None:
        self._out = send
        self._in = receive
        self._frames = FrameBuffer()
        self._decoder: Decoder[M] = Decoder(incoming)
        self._lock = anyio.Lock(fast_acquire=True)  # (free, it takes no event-loop turn)

    async def send(self, message: Message) -> None:
        """Send one message; anyio.BrokenResourceError if the other end is gone."""
        await self.send_many([message])

    async def send_many(self, messages: Sequence[Message]) -> None:
        """Send messages in one write (one system call for a whole claimed batch)."""
        frames = b"".join(encode_frame(message) for message in messages)
        async with self._lock:
            try:
                await self._out.send(frames)
            except (OSError, RuntimeError) as e:  # a pipe closed under a write
                raise anyio.BrokenResourceError(str(e)) from e

    def receive_buffered(self) -> M | None:
        """The next message if its whole frame has been read already, else None (without
        waiting); ProtocolError at a bad frame."""
        body = self._frames.next_body()
        return None if body is None else self._decoder.decode(body)

    async def receive(self) -> M:
        while (body := self._frames.next_body()) is None:
            try:
                chunk = await self._in.receive()  # (as much as is there, up to 64 KiB)
            except anyio.EndOfStream:
                chunk = b""  # (outside the except: a truncated frame's error stands alone)
            if not self._frames.feed(chunk):
                raise anyio.EndOfStream
        return self._decoder.decode(body)

    async def aclose(self) -> None:
        await self._out.aclose()
        await self._in.aclose()
