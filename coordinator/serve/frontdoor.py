"""The front door of `shardctl serve`: what one client can cost the server, bounded.

- a request body over `max_body_bytes` is answered 413 before it is read whole: a Content-Length over the limit
  at once, a chunked body as soon as it passes the limit (`RequestGuard`);
- a request's headers and body must arrive within `request_timeout_s` of its first byte, and a connection that
  sends nothing is closed after as long (`GuardedH11Protocol`, uvicorn's h11 protocol with a deadline): half-sent
  requests cannot pile up;
- at most `max_connections` connections are open; one more is answered 503 and closed at once, before it costs
  a request task (uvicorn's `limit_concurrency` answers 503 only once a request's headers are in, so half-open
  connections would still hold their file descriptors);
- the JSON body is parsed on a worker thread, and a string holding a lone surrogate (not Unicode text) is refused
  there, naming its field (`OffLoopRoute`);
- a client that disconnects before its response is complete has its request cancelled, streaming or not, so its
  sequence is closed after the current step (`RequestGuard`);
- an error that repeats is logged once, then once more with a count (`RepeatedLogFilter`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable, Optional

import h11
from fastapi import HTTPException, Request
from fastapi.routing import APIRoute
from uvicorn.protocols.http.h11_impl import H11Protocol

from coordinator.serve.limits import FrontDoorLimits

log = logging.getLogger("shardctl.serve")


# ---- the connection: a deadline for each request, a bound on connections ------------------------------------

def _raw_response(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": reason.replace(" ", ""), "param": None,
                                 "code": status}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus: a request must be in (headers and body) within the timeout of its first
    byte, a new connection must send its request within the timeout, and connections past the bound are
    answered 503 and closed. Configured through class attributes (`configured`), as uvicorn builds one per
    connection."""

    limits = FrontDoorLimits()
    counters: dict = {"timed_out": 0, "over_limit": 0}

    @classmethod
    def configured(cls, limits: FrontDoorLimits) -> type["GuardedH11Protocol"]:
        return type("GuardedH11Protocol", (cls,), {"limits": limits, "counters": {"timed_out": 0, "over_limit": 0}})

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._deadline: Optional[asyncio.TimerHandle] = None
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.counters["over_limit"] += 1
            log.warning("over the connection limit: %d connections open, limit %d; answered 503",
                        len(self.connections), self.limits.max_connections)
            transport.write(_raw_response(503, "Service Unavailable",
                                          f"the server holds {self.limits.max_connections} connections, its limit "
                                          f"(--max-connections); try again shortly"))
            transport.close()
            return
        self._arm()

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.limits.request_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self._arm()  # the first bytes of a request (after a keep-alive pause) start its clock
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()  # the whole request is in

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()  # an idle keep-alive connection is uvicorn's timeout_keep_alive's

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _expire(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            return
        self.counters["timed_out"] += 1
        log.warning("closed a connection whose request did not arrive within %g s", self.limits.request_timeout_s)
        if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
            self.transport.write(_raw_response(408, "Request Timeout", f"the request did not arrive within "
                                               f"{self.limits.request_timeout_s:g} s"))
        self.transport.close()


# ---- the request: cancelled when its client goes away ---------------------------------------------------------

def _content_length(scope) -> Optional[int]:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class RequestGuard:
    """ASGI middleware around the app: it reads the request body itself, refusing it (413) as soon as it is known
    to pass `max_body_bytes` (its Content-Length, or the bytes of a chunked body so far), so no more than the limit
    is ever held; then it runs the app, watching the client, and if the client leaves before its response is
    complete the request is cancelled (its decoding thread stops at the next step and closes its sequence)."""

    def __init__(self, app, max_body_bytes: int, on_cancel: Optional[Callable[[str], None]] = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.on_cancel = on_cancel

    async def _too_large(self, send, size: Optional[int]) -> None:
        told = f"of {size} bytes " if size is not None else ""
        body = json.dumps({"error": {
            "message": f"the request body {told}is over this server's limit of {self.max_body_bytes} bytes "
                       f"(shardctl serve --max-body-bytes)",
            "type": "RequestTooLargeError", "param": None, "code": 413}}).encode()
        # connection: close: the rest of the body is not worth reading through the event loop to keep the connection
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            return await self._too_large(send, declared)
        chunks, size = [], 0
        while True:  # the body, whole and bounded (uvicorn hands it over in pieces of at most 64 KiB)
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before the request was in (or closed for taking too long)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await self._too_large(send, None)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        disconnected = asyncio.Event()
        response_done = False
        replayed = False

        async def app_receive():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def app_send(message):
            nonlocal response_done
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                response_done = True
            await send(message)

        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()

        app_task = asyncio.ensure_future(self.app(scope, app_receive, app_send))
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({app_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not app_task.done() and disconnected.is_set() and not response_done:
                app_task.cancel()
                if self.on_cancel is not None:
                    self.on_cancel(scope["path"])
                try:
                    await app_task
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():
                        raise
                return
            await app_task
        finally:
            watcher.cancel()
            if not app_task.done():
                app_task.cancel()


# ---- the body: parsed off the event loop, text checked -------------------------------------------------------

class BadField(HTTPException):
    """A field of the request that cannot be served; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(status_code=400, detail=message)
        self.param = param


def _field_path(path: list) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def check_text(value: Any, path: Optional[list] = None) -> None:
    """BadField for the first string (key or value) that is not Unicode text: JSON's "\\ud800" decodes to a lone
    surrogate, which no tokenizer can encode."""
    path = [] if path is None else path
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as error:
                raise BadField(_field_path(where), f"field `{_field_path(where)}` is not valid Unicode text: "
                                                   f"{error.reason} at character {error.start}") from None
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, where))
                stack.append((child, where + [key]))
        elif isinstance(item, list):
            stack.extend((child, where + [index]) for index, child in enumerate(item))


def parse_body(raw: bytes) -> Any:
    """The request's JSON, checked: on a worker thread, so a large body never stalls the event loop."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadField("body", f"the request body is not UTF-8 text: {error.reason} at byte {error.start}") from None
    parsed = json.loads(text)
    check_text(parsed)
    return parsed


class OffLoopRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            raw = await self.body()
            self._json = await asyncio.to_thread(parse_body, raw)
        return self._json


class OffLoopRoute(APIRoute):
    """FastAPI's route, handed a request whose JSON is parsed on a worker thread (FastAPI's documented way to
    customise how a route reads its request)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def off_loop_handler(request: Request):
            return await handler(OffLoopRequest(request.scope, request.receive))

        return off_loop_handler


# ---- the log: a repeated error once, with a count -------------------------------------------------------------

class RepeatedLogFilter(logging.Filter):
    """The first record of a kind (logger, message template) passes; more of it within `window_s` are counted,
    and the next one after the window passes with how many were held back."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self.clock = clock
        self._seen: dict[tuple, list] = {}  # kind -> [window start, held back]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        kind = (record.name, str(record.msg), record.exc_info[0] if record.exc_info else None)
        now = self.clock()
        seen = self._seen.get(kind)
        if seen is not None and now - seen[0] < self.window_s:
            seen[1] += 1
            return False
        held = seen[1] if seen is not None else 0
        self._seen[kind] = [now, 0]
        if len(self._seen) > 1000:  # kinds are templates, but a bound costs nothing
            self._seen = {kind: self._seen[kind]}
        if held:
            record.msg = f"{record.msg} (and {held} more like it in the last {self.window_s:g} s)"
            if record.exc_info:  # the first one carried the traceback
                record.exc_info, record.exc_text = None, None
        return True


class RefusalLog:
    """One warning line per refused request saying why, at most `per_window` lines each `window_s`; the refusals
    over that are counted into the next line logged. Each line is its own message, so the repeat filter only
    folds refusals that are word for word the same."""

    def __init__(self, logger: logging.Logger, per_window: int = 20, window_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.per_window = per_window
        self.window_s = window_s
        self.clock = clock
        self._window_start = -window_s
        self._logged = 0
        self._held = 0

    def __call__(self, line: str) -> None:
        now = self.clock()
        if now - self._window_start >= self.window_s:
            self._window_start, self._logged = now, 0
        if self._logged >= self.per_window:
            self._held += 1
            return
        self._logged += 1
        if self._held:
            line += f" ({self._held} more refusals not logged)"
            self._held = 0
        self.logger.warning(line)  # no arguments: the line is not %-formatted


LOGGERS = ("uvicorn.error", "uvicorn.access", "asyncio", "shardctl.serve")


def install_log_filter(window_s: float = 10.0) -> RepeatedLogFilter:
    repeated = RepeatedLogFilter(window_s)
    for name in LOGGERS:
        logging.getLogger(name).addFilter(repeated)
    return repeated
