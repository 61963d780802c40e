"""The parent's end of a worker's pipes: framed sends and receives on anyio streams.

The messages and their framing are pgjobd.protocol's; this module is the supervisor's
side only, so a worker process never imports anyio.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import anyio
from anyio.abc import ByteReceiveStream, ByteSendStream
from anyio.streams.buffered import BufferedByteReceiveStream

from pgjobd.protocol import HEADER, Decoder, Message, ProtocolError, encode_frame, frame_length

M = TypeVar("M")


class Channel(Generic[M]):
    """The parent's end of a pipe pair: framed sends and receives over anyio byte streams.

    Sends are serialized by a lock, so tasks may share a channel. `receive` raises
    anyio.EndOfStream at a clean end of input (between frames) and ProtocolError at a
    truncated or bad frame.
    """

    def __init__(self, send: ByteSendStream, receive: ByteReceiveStream, incoming: Any) -> None:
        self._out = send
        self._in = BufferedByteReceiveStream(receive)
        self._decoder: Decoder[M] = Decoder(incoming)
        self._lock = anyio.Lock()

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

    async def receive(self) -> M:
        try:
            header = await self._in.receive_exactly(HEADER.size)
        except anyio.IncompleteRead:
            if self._in.buffer:
                raise ProtocolError("input ended inside a frame header") from None
            raise anyio.EndOfStream from None
        length = frame_length(header)
        try:
            body = await self._in.receive_exactly(length)
        except anyio.IncompleteRead:
            raise ProtocolError(f"input ended inside a frame of {length} bytes") from None
        return self._decoder.decode(body)

    async def aclose(self) -> None:
        await self._out.aclose()
        await self._in.aclose()
