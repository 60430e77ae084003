"""Error responses. OpenAI routes (/v1/...) answer OpenAI's error shape, the others TGI's;
no handler ever puts a traceback into a body."""

import json
import logging
import sys

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine.errors import EngineDeadError, QueueFullError

log = logging.getLogger("server.errors")

# OpenAI's `type` for a status; TGI's `error_type` comes from the same table.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}
_TGI_TYPES = {400: "validation", 401: "unauthorized", 404: "not_found", 405: "validation", 413: "validation",
              415: "validation", 422: "validation", 429: "overloaded", 503: "unavailable"}
# Refusals of what a request asked for, counted in llm_requests_rejected_total{reason}.
VALIDATION_STATUSES = frozenset({400, 404, 413, 415, 422})


class ApiError(Exception):
    """``reason``: the label a 4xx refusal is counted under (``VALIDATION_STATUSES``)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None, reason: str = "invalid"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.reason = reason


def count_rejection(request: Request, status: int, reason: str = "invalid") -> None:
    if status in VALIDATION_STATUSES:
        request.app.state.services.metrics.rejected.labels(reason=reason).inc()


async def require_json_body(request: Request) -> None:
    """415 for a POST whose body is not declared JSON (curl's -d alone sends a form type)."""
    if request.method != "POST":
        return
    declared = request.headers.get("content-type", "")
    media_type = declared.partition(";")[0].strip().lower()
    if media_type != "application/json" and not (media_type.startswith("application/") and media_type.endswith("+json")):
        raise ApiError(415, f"the request body must be JSON with Content-Type: application/json, not "
                            f"{declared[:100]!r}" if declared else
                            "the request body must be JSON with Content-Type: application/json (none was given)",
                       headers={"Accept": "application/json"})


def ended_by_shutdown(finish) -> ApiError:
    """503 for a non-streaming request that the server ended while shutting down."""
    return ApiError(503, f"the server is shutting down and ended the request after "
                         f"{finish.completion_tokens} tokens; retry on another replica",
                    headers={"Retry-After": "5"})


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/")


def error_body(path: str, status: int, message: str, param: str | None = None) -> dict:
    if is_openai_path(path):
        return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                          "param": param, "code": status}}
    return {"error": message, "error_type": _TGI_TYPES.get(status, "internal")}


class AsciiJSONResponse(JSONResponse):
    """Error messages may quote what the client sent, which need not be encodable text."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(path: str, status: int, message: str, *, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return AsciiJSONResponse(error_body(path, status, message, param), status_code=status,
                             headers=headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "constrained-str", "constrained-int"}


def _field_name(loc) -> str:
    """'messages.0.content' from pydantic's loc, less the union-member tags it inserts
    (such as 'function-after[_encodable(), str]' or 'list[TextPart]')."""
    parts = [str(p) for p in loc]
    if parts and parts[0] == "body":
        parts = parts[1:]
    parts = [p for p in parts if "[" not in p and p not in _TYPE_TAGS]
    return ".".join(parts) or "body"


def describe_validation_errors(errors) -> tuple[str, str | None]:
    """('messages.0.role: Input should be ...; ...', first field name)."""
    described, first = [], None
    for err in errors:
        field = _field_name(err.get("loc", ()))
        first = first or field
        message = err.get("msg", "invalid value")
        # pydantic's "Value error, x" reads better as "x"
        message = message.removeprefix("Value error, ")
        if f"{field}: {message}" not in described:
            described.append(f"{field}: {message}")
    return "; ".join(described) or "invalid request body", first


def retry_after_header(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, int(round(seconds + 0.499))))}


def body_parse_error(cause: BaseException) -> str:
    """What FastAPI's "There was an error parsing the body" was: the parser's own complaint."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"the request body is not valid UTF-8 JSON: {cause.reason} at byte position "
                f"{cause.start}")
    if isinstance(cause, RecursionError):
        return "malformed JSON body: nested too deeply for the parser"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return f"malformed JSON body: a number of more than {sys.get_int_max_str_digits()} digits"
    return f"malformed request body: {type(cause).__name__}: {cause}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        count_rejection(request, exc.status, exc.reason)
        return error_response(request.url.path, exc.status, exc.message, param=exc.param,
                              headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        count_rejection(request, 422)
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            detail = next(e for e in errors if e.get("type") == "json_invalid")
            reason = (detail.get("ctx") or {}).get("error", "JSON decode error")
            pos = detail.get("loc", ("body", "?"))[-1]
            return error_response(request.url.path, 400,
                                  f"malformed JSON body: {reason} at position {pos}")
        message, field = describe_validation_errors(errors)
        return error_response(request.url.path, 422, message, param=field)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 400 and exc.__cause__ is not None:
            message = body_parse_error(exc.__cause__)
        if exc.status_code in (400, 413):           # a body that could not be read or parsed
            count_rejection(request, exc.status_code)
        return error_response(request.url.path, exc.status_code, message, headers=exc.headers)

    @app.exception_handler(QueueFullError)
    async def _queue_full(request: Request, exc: QueueFullError):
        return error_response(request.url.path, 429, f"server is overloaded: {exc}",
                              headers=retry_after_header(exc.retry_after))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError):
        return error_response(request.url.path, 503, "the engine has stopped; see /health")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.error("unhandled error", exc_info=exc,
                  extra={"fields": {"request_id": getattr(request.state, "request_id", None),
                                    "path": request.url.path}})
        return error_response(request.url.path, 500, "internal server error")
