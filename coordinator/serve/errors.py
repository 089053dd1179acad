"""OpenAI error objects and a request's refusals: a status's type, a wrong model or field, a 400's message."""

from __future__ import annotations

import functools
from typing import Optional

from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from coordinator.relay.pipeline import SHARD_FAILURES
from coordinator.relay.shards import PipelineError
from coordinator.relay.target import RollbackFailed, SequenceLost
from coordinator.serve.engine import Engine, RequestError
from coordinator.serve.protocol import ErrorInfo, ErrorResponse

ERROR_KINDS = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
               413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


# failures of the shards (down, restarting, replaced), answered 503 without a traceback: not this server's defect
SHARD_DOWN = (*SHARD_FAILURES, ConnectionError, PipelineError, SequenceLost, RollbackFailed)


def error_response(status: int, message: str, kind: Optional[str] = None, param: Optional[str] = None,
                   headers: Optional[dict] = None) -> JSONResponse:
    """OpenAI's error object: {"error": {message, type, param, code}}."""
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind or ERROR_KINDS.get(status, "HTTPError"),
                                         param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _field(location) -> str:
    parts = [str(part) for part in location if part != "body"]
    return ".".join(parts) or "body"


def validation_message(error: RequestValidationError) -> tuple[str, Optional[str]]:
    """A 400's message and the field it names: a body that is not JSON, an unknown field by name
    (extra="forbid"), else each problem as `field: what is wrong`."""
    problems = error.errors()
    for problem in problems:
        if problem.get("type") == "json_invalid":
            reason = (problem.get("ctx") or {}).get("error", problem.get("msg"))
            return f"the request body is not valid JSON: {reason}", None
    unknown = sorted({str(e["loc"][-1]) for e in problems if e.get("type") == "extra_forbidden"})
    if unknown:
        return f"unsupported field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}", unknown[0]
    if not problems:
        return "the request is not valid", None
    listed = "; ".join(f"{_field(e['loc'])}: {e['msg']}" for e in problems[:8])
    more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
    return f"the request is not valid: {listed}{more}", _field(problems[0]["loc"])


def not_found_model(name: str) -> HTTPException:
    missing = HTTPException(404, f"The model `{name}` does not exist.")
    missing.param = "model"
    return missing


def refuse(message: str, param: str):
    error = RequestError(message)
    error.param = param
    raise error


def check_common(engine: Engine, body) -> Optional[JSONResponse]:
    if body.model is not None and body.model != engine.model_name:
        raise not_found_model(body.model)
    name = getattr(body, "unsupported", lambda: None)()
    if name is not None:
        value = functools.reduce(getattr, name.split("."), body)
        refuse(f"'{name}' is not supported by this server (value {value!r})", name)
    options = getattr(body, "stream_options", None)
    if options is not None and options.model_fields_set and not getattr(body, "stream", False):
        refuse("'stream_options' is only allowed when 'stream' is true", "stream_options")  # as OpenAI and vLLM
    return None
