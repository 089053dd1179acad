"""Streams as server-sent events: an event's text, a failure's events, several streams merged as items arrive."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from coordinator.serve.protocol import ErrorInfo, ErrorResponse


def sse(payload) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json(exclude_none=False)
    return f"data: {data}\n\n"


def error_events(error: Exception) -> str:
    body = ErrorResponse(error=ErrorInfo(message=str(error), type="InternalServerError", code=500))
    return sse(body.model_dump_json()) + sse("[DONE]")


async def merged(streams: list) -> AsyncIterator[tuple[int, object]]:
    """(choice index, item) from several async iterators as items arrive; the first failure is raised."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, done))
        except Exception as error:  # noqa: BLE001 - raised in the consumer
            await queue.put((index, error))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
