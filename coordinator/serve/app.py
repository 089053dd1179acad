"""The FastAPI app of `shardctl serve`: thin routes over `Engine`, OpenAI's request and response shapes
(`coordinator.serve.protocol`), streaming as server-sent events from an async generator, errors as OpenAI
error objects."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator, Optional

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coordinator.serve.chat import ChatTemplateError
from coordinator.serve.engine import Engine, GenerateParams, RequestError
from coordinator.serve.frontdoor import OffLoopRoute, RequestGuard
from coordinator.serve.limits import FrontDoorLimits, default_max_body_bytes
from coordinator.serve.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseMessage,
    UsageInfo,
    random_id,
)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions default
HEALTH_FRESH_S = 1.0  # /health checks the shards again once its last check is this old
HEALTH_STALE_S = 5.0  # and waits for that check only when the last one is older than this

log = logging.getLogger("shardctl.serve")


def error_response(status: int, message: str, kind: str = "BadRequestError", param: Optional[str] = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def usage_of(result) -> UsageInfo:
    completion = len(result.tokens) if result is not None else 0
    prompt = result.prompt_tokens if result is not None else 0
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def sse(payload) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json(exclude_none=False)
    return f"data: {data}\n\n"


def build_app(engine: Engine, limits: Optional[FrontDoorLimits] = None) -> FastAPI:
    app = FastAPI(title="shardd", description="OpenAI-compatible API over shardd shard daemons")
    app.router.route_class = OffLoopRoute  # request bodies are parsed on a worker thread
    metrics = engine.metrics
    limits = limits or FrontDoorLimits(max_body_bytes=default_max_body_bytes(engine.max_context))

    @app.exception_handler(RequestError)
    async def request_error(request: Request, error: RequestError):
        metrics.requests.labels(request.url.path, "400").inc()
        return error_response(400, str(error))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        metrics.requests.labels(request.url.path, str(error.status_code)).inc()
        kind = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestTooLargeError"}.get(error.status_code,
                                                                                              "HTTPError")
        return error_response(error.status_code, str(error.detail), kind, getattr(error, "param", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        metrics.requests.labels(request.url.path, "400").inc()
        return error_response(400, json.dumps(error.errors(), default=str))

    checked = {"at": -HEALTH_STALE_S, "answer": None, "refresh": None}

    async def refresh_health():
        checked["answer"] = await asyncio.to_thread(engine.health)
        checked["at"] = time.monotonic()

    @app.get("/health")
    async def health():
        # A probe storm costs one shard check per HEALTH_FRESH_S; an answer up to HEALTH_STALE_S old is served
        # at once while the next check runs, so /health stays fast whatever the shards take to answer.
        age = time.monotonic() - checked["at"]
        if age > HEALTH_FRESH_S and (checked["refresh"] is None or checked["refresh"].done()):
            checked["refresh"] = asyncio.ensure_future(refresh_health())
        if age > HEALTH_STALE_S:
            await asyncio.shield(checked["refresh"])
        ready, body = checked["answer"]
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=engine.model_name, max_model_len=engine.max_context)])

    def check_common(body) -> Optional[JSONResponse]:
        if body.model is not None and body.model != engine.model_name:
            return error_response(404, f"The model `{body.model}` does not exist.", "NotFoundError", "model")
        if body.n != 1:
            raise RequestError("only n=1 is supported")
        if body.logprobs:
            raise RequestError("logprobs are not supported")
        return None

    def params_of(body, prompt_ids: list[int], max_tokens: Optional[int], default_max: int) -> GenerateParams:
        engine.check_prompt(prompt_ids)
        return GenerateParams(
            prompt_ids=prompt_ids,
            max_tokens=default_max if max_tokens is None else max_tokens,
            sampling=engine.sampling(body.temperature, body.top_p, body.top_k, body.seed),
            stop=body.stop_strings(),
            ignore_eos=body.ignore_eos,
        )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        refused = check_common(body)
        if refused is not None:
            return refused
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise RequestError("one prompt per request (a list of several prompts is not supported)")
            prompt = prompt[0]
        ids = await asyncio.to_thread(engine.tokenizer.encode, prompt) if isinstance(prompt, str) else list(prompt)
        params = params_of(body, ids, body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS)
        prefix = (prompt if isinstance(prompt, str) else engine.tokenizer.decode(ids)) if body.echo else ""
        route = "/v1/completions"
        if body.stream:
            return StreamingResponse(stream_completion(params, prefix, body.include_usage(), route),
                                     media_type="text/event-stream")
        text, result = await engine.complete(params)
        metrics.requests.labels(route, "200").inc()
        return CompletionResponse(model=engine.model_name, usage=usage_of(result), choices=[
            CompletionChoice(text=prefix + text, finish_reason=result.finish_reason)])

    async def stream_completion(params: GenerateParams, prefix: str, include_usage: bool, route: str) -> AsyncIterator[str]:
        ident, created = random_id("cmpl"), int(time.time())

        def chunk(text: str, finish_reason=None, usage=None) -> str:
            return sse(CompletionResponse(id=ident, created=created, model=engine.model_name, usage=usage,
                                          choices=[] if usage is not None and not text and finish_reason is None else
                                          [CompletionChoice(text=text, finish_reason=finish_reason)]))

        async for item in guarded(engine.generate(params), route):
            if isinstance(item, str):
                yield item
                return
            if prefix:
                yield chunk(prefix)
                prefix = ""
            if item.result is None:
                if item.text:
                    yield chunk(item.text)
                continue
            yield chunk(item.text, item.finish_reason)
            if include_usage:
                yield chunk("", usage=usage_of(item.result))
        yield sse("[DONE]")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        refused = check_common(body)
        if refused is not None:
            return refused
        if engine.chat_template is None:
            raise RequestError("the model ships no chat template (chat_template.jinja or tokenizer_config.json's "
                               "chat_template); use /v1/completions")
        def render_and_encode() -> list[int]:  # on a worker thread: a template and a tokenizer take time
            try:
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                text = engine.chat_template.render(messages, body.add_generation_prompt,
                                                   **(body.chat_template_kwargs or {}))
            except (ChatTemplateError, ValueError) as error:
                raise RequestError(str(error)) from None
            return engine.tokenizer.encode(text)

        ids = await asyncio.to_thread(render_and_encode)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = params_of(body, ids, max_tokens, engine.max_context - len(ids))
        route = "/v1/chat/completions"
        if body.stream:
            return StreamingResponse(stream_chat(params, body.include_usage(), route), media_type="text/event-stream")
        content, result = await engine.complete(params)
        metrics.requests.labels(route, "200").inc()
        return ChatCompletionResponse(model=engine.model_name, usage=usage_of(result), choices=[
            ChatChoice(message=ResponseMessage(content=content), finish_reason=result.finish_reason)])

    async def stream_chat(params: GenerateParams, include_usage: bool, route: str) -> AsyncIterator[str]:
        ident, created = random_id("chatcmpl"), int(time.time())

        def chunk(delta: Optional[DeltaMessage], finish_reason=None, usage=None) -> str:
            choices = [] if delta is None else [ChatStreamChoice(delta=delta, finish_reason=finish_reason)]
            return sse(ChatCompletionChunk(id=ident, created=created, model=engine.model_name, choices=choices,
                                           usage=usage))

        yield chunk(DeltaMessage(role="assistant", content=""))
        async for item in guarded(engine.generate(params), route):
            if isinstance(item, str):
                yield item
                return
            if item.result is None:
                if item.text:
                    yield chunk(DeltaMessage(content=item.text))
                continue
            yield chunk(DeltaMessage(content=item.text) if item.text else DeltaMessage(), item.finish_reason)
            if include_usage:
                yield chunk(None, usage=usage_of(item.result))
        yield sse("[DONE]")

    async def guarded(deltas, route: str):
        """The engine's deltas; a failure mid-stream becomes an error event (the status line is already sent)."""
        try:
            async for delta in deltas:
                yield delta
            metrics.requests.labels(route, "200").inc()
        except Exception as error:  # noqa: BLE001 - reported to the client in the stream
            metrics.requests.labels(route, "500").inc()
            log.error("500 in a stream of %s: %s: %s", route, type(error).__name__, error, exc_info=error)
            body = ErrorResponse(error=ErrorInfo(message=str(error), type="InternalServerError", code=500))
            yield sse(body.model_dump_json()) + sse("[DONE]")
        finally:
            await deltas.aclose()

    @app.middleware("http")
    async def failures(request: Request, call_next):
        try:
            return await call_next(request)
        except Exception as error:  # noqa: BLE001 - a shard failure outside a stream: an OpenAI error object
            metrics.requests.labels(request.url.path, "500").inc()
            log.error("500 for %s %s: %s: %s", request.method, request.url.path, type(error).__name__, error,
                      exc_info=error)
            return error_response(500, f"{type(error).__name__}: {error}", "InternalServerError")

    def cancelled(path: str) -> None:
        metrics.requests.labels(path, "499").inc()  # nginx's "client closed request"
        log.info("client went away: request to %s cancelled, its sequence closed", path)

    app.add_middleware(RequestGuard, max_body_bytes=limits.max_body_bytes, on_cancel=cancelled)
    return app
