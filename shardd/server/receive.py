"""One request off the daemon's ROUTER socket, frame by frame, holding no more frames than its type allows.

A request's frame count is known from its type: the header plus one frame per tensor the type carries
(`REQUEST_TENSORS`). Frames past that are received and dropped one at a time (a ZeroMQ multipart message must be
read whole to reach the next one), so a message of many frames, each under the frame limit, is refused without
Python holding its frames; afterwards the allocator gives the freed memory back to the system (`release_memory`).
libzmq itself hands a multipart message over only once all of it has arrived, so what bounds the bytes in
flight is the frame limit times the frames in libzmq's queue (PROTOCOL.md, "Limits").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass
from typing import Optional

import zmq

from protocol import BATCH_TENSORS, REQUEST_TENSORS, ErrorCode, MessageType, peek_kind

log = logging.getLogger("shardd")

# A header whose type cannot be read is refused for its header; the frames it may bring are the most any type allows.
MOST_FRAMES = 1 + max(max(len(specs) for specs in REQUEST_TENSORS.values()), max(map(len, BATCH_TENSORS.values())))


def frames_allowed(type_name: Optional[str], batched: bool = False) -> int:
    """Frames a request of this type may have: its header and one per tensor it carries (a batch: its batch's)."""
    if type_name is None:
        return MOST_FRAMES
    mtype = MessageType(type_name)
    if batched and mtype in BATCH_TENSORS:
        return 1 + len(BATCH_TENSORS[mtype])
    return 1 + len(REQUEST_TENSORS[mtype])


@dataclass
class Received:
    envelope: list  # the routing id (and a REQ client's empty delimiter), to address the reply
    body: list  # the request's frames, at most frames_allowed of its type
    dropped: int = 0  # frames past that, received and let go
    dropped_bytes: int = 0

    def refusal_code(self, max_frames: int) -> ErrorCode:
        """TOO_LARGE past the frame limit of any message (`Limits.max_frames`), else BAD_REQUEST, as decoding
        a message of too many frames answered before frames were counted by type."""
        return ErrorCode.TOO_LARGE if len(self.body) + self.dropped > max_frames else ErrorCode.BAD_REQUEST

    @property
    def refusal(self) -> Optional[str]:
        """Why the message is refused before it is decoded (None: decode it)."""
        if not self.dropped:
            return None
        type_name, batched = peek_kind(self.body)
        allowed = len(self.body)
        total = allowed + self.dropped
        what = f"a {type_name} {'batch' if batched else 'request'}" if type_name else "a request whose type cannot be read"
        return (f"{what} has at most {allowed} frame(s) (the header and its tensors); this message had {total} "
                f"frames ({self.dropped_bytes} bytes past the first {allowed} dropped unread)")


def receive_request(socket: zmq.Socket) -> Received:
    """The next message on a ROUTER socket that has one ready (POLLIN)."""
    received = Received([socket.recv(copy=False)], [])
    limit = MOST_FRAMES
    while socket.getsockopt(zmq.RCVMORE):
        frame = socket.recv(copy=False)
        if received.dropped or len(received.body) >= limit:
            received.dropped += 1
            received.dropped_bytes += len(frame.buffer)
            del frame  # let libzmq's buffer go now, not after the whole message
            continue
        if not received.body and len(received.envelope) == 1 and len(frame.buffer) == 0 \
                and socket.getsockopt(zmq.RCVMORE):
            received.envelope.append(frame)  # a REQ client's empty delimiter
            continue
        received.body.append(frame)
        if len(received.body) == 1:
            limit = frames_allowed(*peek_kind(received.body))
    return received


_libc = None


def release_memory() -> None:
    """Give the allocator's free memory back to the system (glibc's malloc_trim; elsewhere nothing): a refused
    message of many large frames must not leave the daemon hundreds of megabytes larger."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
            if _libc and not hasattr(_libc, "malloc_trim"):
                _libc = False
        except OSError:
            _libc = False
    if _libc:
        _libc.malloc_trim(0)
