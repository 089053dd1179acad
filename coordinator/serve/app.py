"""The FastAPI app of `shardctl serve`: thin routes over `Engine`, OpenAI's request and response shapes
(`coordinator.serve.protocol`), streaming as server-sent events from an async generator, errors as OpenAI
error objects. `n > 1` runs n sequences of the same prompt, choice i with seed + i (as vLLM seeds them); a
completion's list of prompts runs each prompt's n sequences, choice `prompt * n + i`, all submitted at once."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from common import __version__
from coordinator.serve.auth import authorized, needs_key
from coordinator.serve.chat import chat_prompt
from coordinator.serve.choices import chat_choices, complete_all, grammar_of, params_of, usage_of
from coordinator.serve.engine import Engine, GenerateParams, RequestError
from coordinator.serve.errors import ERROR_KINDS  # noqa: F401 - still importable from here
from coordinator.serve.errors import (
    SHARD_DOWN, check_common, error_response, not_found_model, refuse, validation_message,
)
from coordinator.serve.frontdoor import OffLoopRoute, RefusalLog, RequestGuard
from coordinator.serve.limits import MAX_CHOICE_TOKENS, MAX_CHOICES, FrontDoorLimits, default_max_body_bytes
from coordinator.serve.logprobs import CompletionShape, chat_logprobs, joined, vllm_prompt_logprobs
from coordinator.serve.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ResponseMessage,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    random_id,
)
from coordinator.serve.responses import (
    ResponseEvents,
    ResponsesError,
    ResponseShape,
    ResponsesRequest,
    output_items,
)
from coordinator.serve.responses import usage as response_usage
from coordinator.serve.streaming import error_events, merged, sse
from coordinator.serve.tools import ToolCallStream, parse_tool_calls

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions default
HEALTH_FRESH_S = 1.0  # /health checks the shards again once its last check is this old
HEALTH_STALE_S = 5.0  # and waits for that check only when the last one is older than this

log = logging.getLogger("shardctl.serve")


def build_app(engine: Engine, api_key: Optional[str] = None, limits: Optional[FrontDoorLimits] = None) -> FastAPI:
    app = FastAPI(title="shardd", description="OpenAI-compatible API over shardd shard daemons")
    app.router.route_class = OffLoopRoute  # request bodies are parsed on a worker thread
    metrics = engine.metrics
    limits = limits or FrontDoorLimits(max_body_bytes=default_max_body_bytes(engine.max_context))
    refusal_log = RefusalLog(log)

    def refused(request: Request, status: int, message: str, param: Optional[str] = None,
                headers: Optional[dict] = None) -> JSONResponse:
        """A refusal: counted, logged in one line saying why (repeats held back by the serve log's filter), and
        answered as OpenAI's error object."""
        route = request.scope.get("route")
        metrics.requests.labels(route.path if route is not None else "unrouted", str(status)).inc()
        refusal_log(f"refused {request.method} {request.url.path[:200]} with {status}: {message[:400]}")
        return error_response(status, message, param=param, headers=headers)

    @app.exception_handler(RequestError)
    async def request_error(request: Request, error: RequestError):
        return refused(request, 400, str(error), getattr(error, "param", None))

    @app.exception_handler(StarletteHTTPException)  # FastAPI's HTTPException and the router's own 404 and 405
    async def http_error(request: Request, error: StarletteHTTPException):
        message = str(error.detail)
        if error.status_code == 404 and request.scope.get("route") is None:
            message = f"no route {request.url.path} on this server ({message})"
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path} ({message})"
        return refused(request, error.status_code, message, getattr(error, "param", None), error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        message, param = validation_message(error)
        return refused(request, 400, message, param)

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

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=engine.model_name, max_model_len=engine.max_context)])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != engine.model_name:
            raise not_found_model(model_id)
        return ModelCard(id=engine.model_name, max_model_len=engine.max_context)

    # ---- completions ---------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        refused = check_common(engine, body)
        if refused is not None:
            return refused
        prompts = body.prompt
        several = isinstance(prompts, list) and bool(prompts) and all(isinstance(p, (str, list)) for p in prompts)
        prompts = list(prompts) if several else [prompts]
        if len(prompts) * body.n > MAX_CHOICES and body.n <= MAX_CHOICES:
            refuse(f"'prompt' x 'n' is at most {MAX_CHOICES} choices on this server (got {len(prompts)} prompts x "
                   f"{body.n})", "prompt")
        encode = engine.tokenizer.encode
        ids = await asyncio.to_thread(lambda: [encode(p) if isinstance(p, str) else list(p) for p in prompts])
        # an echo with logprobs starts with the prompt's entries; vLLM's prompt_logprobs asks for its own top
        asked = [k for k in (body.logprobs if body.echo else None, body.prompt_logprobs) if k is not None]
        prompt_top = max(asked) if asked else None
        grammar = grammar_of(body.response_format)
        choices = await asyncio.to_thread(lambda: [  # a grammar compiles on a worker thread
            choice for prompt_ids in ids for choice in params_of(
                engine, body, prompt_ids, body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, body.logprobs, prompt_top,
                grammar)])
        budget = sum(choice.max_tokens for choice in choices)
        if len(prompts) > 1 and budget > MAX_CHOICE_TOKENS:
            refuse(f"'prompt' x 'n' x 'max_tokens' is at most {MAX_CHOICE_TOKENS} tokens on this server (got "
                   f"{len(prompts)} prompts x {body.n} x {choices[0].max_tokens} or fewer: {budget})", "prompt")
        echoed = [(prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt_ids)) if body.echo else ""
                  for prompt, prompt_ids in zip(prompts, ids)]
        prefixes = [prefix for prefix in echoed for _ in range(body.n)]  # per choice
        shape = CompletionShape(engine.tokenizer, body.echo, body.logprobs, body.prompt_logprobs)
        route = "/v1/completions"
        if body.stream:
            return StreamingResponse(stream_completion(choices, prefixes, shape, body.n, body.include_usage(), route),
                                     media_type="text/event-stream")
        outputs = await complete_all(engine, choices)
        metrics.requests.labels(route, "200").inc()
        answers = []
        for i, (choice, prefix, (text, result, entries)) in enumerate(zip(choices, prefixes, outputs)):
            logprobs = shape.generated(entries, len(prefix))
            if shape.echo_scores:
                logprobs = joined(shape.echoed(choice.prompt_ids, result.prompt_logprobs), logprobs)
            answers.append(CompletionChoice(index=i, text=prefix + text, finish_reason=result.finish_reason,
                                            logprobs=logprobs,
                                            prompt_logprobs=shape.vllm(choice.prompt_ids, result.prompt_logprobs)))
        return CompletionResponse(model=engine.model_name, choices=answers,
                                  usage=usage_of([r for _, r, _ in outputs], body.n))

    async def stream_completion(choices: list[GenerateParams], prefixes: list[str], shape: CompletionShape,
                                per_prompt: int, include_usage: bool, route: str) -> AsyncIterator[str]:
        ident, created = random_id("cmpl"), int(time.time())
        offsets = [0] * len(choices)
        results: list = [None] * len(choices)

        def chunk(index: int, text: str, finish_reason=None, entries=None, scores=None, prompt_scores=None) -> str:
            if scores is None:
                scores = shape.generated(entries or [], offsets[index])
            offsets[index] += len(text)
            return sse(CompletionResponse(id=ident, created=created, model=engine.model_name, choices=[
                CompletionChoice(index=index, text=text, finish_reason=finish_reason, logprobs=scores,
                                 prompt_logprobs=prompt_scores)]))

        for index, (choice, prefix) in enumerate(zip(choices, prefixes)):
            if prefix and choice.prompt_logprobs is None:  # a scored prompt's echo comes with its scores
                yield chunk(index, prefix)
        async for index, item in guarded(merged([engine.generate(params) for params in choices]), route):
            if isinstance(item, str):
                yield item
                return
            if item.prompt_logprobs is not None:
                prompt = choices[index].prompt_ids
                scores = shape.echoed(prompt, item.prompt_logprobs) if shape.echo_scores else None
                yield chunk(index, prefixes[index], scores=scores,
                            prompt_scores=shape.vllm(prompt, item.prompt_logprobs))
                continue
            if item.result is None:
                if item.text or item.logprobs:
                    yield chunk(index, item.text, entries=item.logprobs)
                continue
            results[index] = item.result
            yield chunk(index, item.text, item.finish_reason, item.logprobs)
        if include_usage:
            yield sse(CompletionResponse(id=ident, created=created, model=engine.model_name, choices=[],
                                         usage=usage_of(results, per_prompt)))
        yield sse("[DONE]")

    # ---- chat ----------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        refused = check_common(engine, body)
        if refused is not None:
            return refused
        if body.prompt_logprobs is not None and body.stream:
            refuse("'prompt_logprobs' is answered on a whole chat completion, not a stream (stream: false)",
                   "prompt_logprobs")
        choices, top, parse_tools = await chat_choices(engine, body)
        if body.prompt_logprobs is not None:  # the response carries the prompt's scores once: the first choice's
            choices[0] = dataclasses.replace(choices[0], prompt_logprobs=body.prompt_logprobs)
        route = "/v1/chat/completions"
        if body.stream:
            return StreamingResponse(stream_chat(choices, top, parse_tools, body.include_usage(), route),
                                     media_type="text/event-stream")
        outputs = await complete_all(engine, choices)
        metrics.requests.labels(route, "200").inc()
        answers = []
        for i, (content, result, entries) in enumerate(outputs):
            calls, finish = [], result.finish_reason
            if parse_tools:
                content, calls = parse_tool_calls(content)
                finish = "tool_calls" if calls and finish != "length" else finish  # a call cut short: length
            answers.append(ChatChoice(index=i, message=ResponseMessage(content=content, tool_calls=calls),
                                      finish_reason=finish,
                                      logprobs=None if top is None else chat_logprobs(engine.tokenizer, entries, top)))
        prompt_scores = None
        if body.prompt_logprobs is not None:  # every choice scored the same prompt: the first one's
            prompt_scores = vllm_prompt_logprobs(engine.tokenizer, choices[0].prompt_ids, outputs[0][1].prompt_logprobs,
                                                 body.prompt_logprobs)
        return ChatCompletionResponse(model=engine.model_name, usage=usage_of([r for _, r, _ in outputs]),
                                      choices=answers, prompt_logprobs=prompt_scores)

    async def stream_chat(choices: list[GenerateParams], top: Optional[int], parse_tools: bool, include_usage: bool,
                          route: str) -> AsyncIterator[str]:
        ident, created = random_id("chatcmpl"), int(time.time())
        parsers = [ToolCallStream() if parse_tools else None for _ in choices]
        results: list = [None] * len(choices)

        def chunk(index: int, delta: DeltaMessage, finish_reason=None, entries=None) -> str:
            scores = None if top is None or entries is None else chat_logprobs(engine.tokenizer, entries, top)
            return sse(ChatCompletionChunk(id=ident, created=created, model=engine.model_name, choices=[
                ChatStreamChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=scores)]))

        def deltas(index: int, text: str, final: bool) -> list[DeltaMessage]:
            parser = parsers[index]
            if parser is None:
                return [DeltaMessage(content=text)] if text else []
            events = parser.feed(text) + (parser.finish() if final else [])
            out = []
            for event in events:
                if isinstance(event, str):
                    out.append(DeltaMessage(content=event))
                else:
                    out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                        index=parser.calls_sent, id=event.id, type="function",
                        function=DeltaFunctionCall(name=event.function.name, arguments=event.function.arguments))]))
                    parser.calls_sent += 1
            return out

        for index in range(len(choices)):
            yield chunk(index, DeltaMessage(role="assistant", content=""))
        async for index, item in guarded(merged([engine.generate(params) for params in choices]), route):
            if isinstance(item, str):
                yield item
                return
            final = item.result is not None
            messages = deltas(index, item.text, final)
            entries = item.logprobs if top is not None else None
            if not final:
                for n, message in enumerate(messages):
                    yield chunk(index, message, entries=entries if n == 0 else None)
                if not messages and entries:
                    yield chunk(index, DeltaMessage(), entries=entries)
                continue
            results[index] = item.result
            for message in messages:
                yield chunk(index, message, entries=entries)
                entries = None
            parser = parsers[index]
            finish = ("tool_calls" if parser is not None and parser.calls and item.finish_reason != "length"
                      else item.finish_reason)
            yield chunk(index, DeltaMessage(), finish, entries)
        if include_usage:
            yield sse(ChatCompletionChunk(id=ident, created=created, model=engine.model_name, choices=[],
                                          usage=usage_of(results)))
        yield sse("[DONE]")

    async def guarded(deltas, route: str, on_error=error_events):
        """The engine's deltas; a failure mid-stream becomes the stream's error events (`on_error`'s text: the
        status line is already sent)."""
        try:
            async for delta in deltas:
                yield delta
            metrics.requests.labels(route, "200").inc()
        except Exception as error:  # noqa: BLE001 - reported to the client in the stream
            metrics.requests.labels(route, "500").inc()
            log.error("500 in a stream of %s: %s: %s", route, type(error).__name__, error, exc_info=error)
            yield None, on_error(error)
        finally:
            await deltas.aclose()

    # ---- responses (the chat path, answered as the Responses API) ----------------------------------------

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest):
        refused = check_common(engine, body)
        if refused is not None:
            return refused
        try:
            problem = body.refusal()
            if problem is not None:
                raise problem
            chat = body.chat_request()
        except ResponsesError as error:
            refuse(str(error), error.param)
        (choice,), _, parse_tools = await chat_choices(engine, chat)
        shape = ResponseShape(body, engine.model_name)
        route = "/v1/responses"
        if body.stream:
            return StreamingResponse(stream_response(choice, shape, parse_tools, route),
                                     media_type="text/event-stream")
        ((content, result, _),) = await complete_all(engine, [choice])
        metrics.requests.labels(route, "200").inc()
        calls = []
        if parse_tools:
            content, calls = parse_tool_calls(content)
        output = output_items(content, calls)
        return JSONResponse(shape.body(shape.status_of(result.finish_reason), output,
                                       response_usage(result.prompt_tokens, len(result.tokens), result.cached_tokens)))

    async def stream_response(choice: GenerateParams, shape: ResponseShape, parse_tools: bool,
                              route: str) -> AsyncIterator[str]:
        events = ResponseEvents(shape, parse_tools)
        for event in events.start():
            yield event
        failed = lambda error: "".join(events.failed(str(error)))  # noqa: E731
        async for _, item in guarded(merged([engine.generate(choice)]), route, on_error=failed):
            if isinstance(item, str):
                yield item
                return
            for event in events.feed(item.text, item.result is not None):
                yield event
            if item.result is not None:
                result = item.result
                for event in events.finish(result.prompt_tokens, len(result.tokens), result.finish_reason, result.cached_tokens):
                    yield event

    # ---- tokenizer endpoints (vLLM's) ----------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(body: Union[TokenizeCompletionRequest, TokenizeChatRequest]):
        refused = check_common(engine, body)
        if refused is not None:
            return refused
        if isinstance(body, TokenizeChatRequest):  # on a worker thread, as for a completion: never on the loop
            ids = await asyncio.to_thread(chat_prompt, engine, body.messages, body.tools, body.add_generation_prompt,
                                          body.chat_template_kwargs)
        else:
            ids = await asyncio.to_thread(engine.tokenizer.encode, body.prompt)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_context, tokens=ids)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        refused = check_common(engine, body)
        if refused is not None:
            return refused
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            refuse(f"token id {bad[0]} is outside the vocabulary 0..{engine.vocab_size - 1}", "tokens")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))

    @app.middleware("http")
    async def shard_lost(request: Request, call_next):
        # a launched shard that could not be brought back: every model route answers 503 (/health says why too)
        if engine.lost is not None and request.url.path.startswith(("/v1/", "/tokenize", "/detokenize")):
            return refused(request, 503, f"the server cannot serve: {engine.lost}")
        return await call_next(request)

    @app.middleware("http")
    async def failures(request: Request, call_next):
        try:
            return await call_next(request)
        except Exception as error:  # noqa: BLE001 - a shard failure outside a stream: an OpenAI error object
            while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:  # a TaskGroup's one failure
                error = error.exceptions[0]
            if isinstance(error, SHARD_DOWN):  # the shards, not this server: 503, said in one line
                return refused(request, 503, f"the shards cannot serve this request now ({type(error).__name__}: "
                                             f"{error}); retry")
            metrics.requests.labels(request.url.path, "500").inc()
            log.error("500 for %s %s: %s: %s", request.method, request.url.path, type(error).__name__, error,
                      exc_info=error)
            return error_response(500, f"{type(error).__name__}: {error}", "InternalServerError")

    if api_key:
        @app.middleware("http")
        async def authentication(request: Request, call_next):
            if request.method != "OPTIONS" and needs_key(request.url.path) and \
                    not authorized(request.headers.get("authorization"), api_key):
                return refused(request, 401, "Unauthorized: a valid API key is required (Authorization: Bearer <key>)")
            return await call_next(request)

    def cancelled(path: str) -> None:
        metrics.requests.labels(path, "499").inc()  # nginx's "client closed request"
        log.info("client went away: request to %s cancelled, its sequence closed", path)

    app.add_middleware(RequestGuard, max_body_bytes=limits.max_body_bytes, on_cancel=cancelled)
    return app
