"""Errors in OpenAI's shape, and the middleware that turns every failure into one.

Every error the server sends, whatever raised it (a bad field, a route that does not
exist, a body that is too large, a bug), has the body OpenAI's API uses::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}
"""

from __future__ import annotations

import logging
from dataclasses import fields

import orjson
from aiohttp import web

from pagoda.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))

#: OpenAI's error ``type`` for each status the server sends.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error to send to the client as ``{"error": {...}}``.

    Args:
        status: HTTP status code.
        message: What went wrong, for a human; names the field and the limit.
        param: The request field at fault, if any.
        code: A machine-readable code (``model_not_found``, ``context_length_exceeded``...).
        headers: Extra response headers (``Retry-After``, ``WWW-Authenticate``).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_response(self) -> web.Response:
        return web.Response(status=self.status, body=orjson.dumps(self.to_dict()), content_type="application/json",
                            headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 naming the field at fault."""
    return APIError(400, message, param=param, code=code)


def from_value_error(exc: ValueError, default_param: str | None = None) -> APIError:
    """Turns an engine ValueError into a 400.

    SamplingParams' messages start with the field name ("temperature must be >= 0, ..."),
    which becomes ``param``; other messages (about the prompt) get ``default_param``.
    """
    message = str(exc)
    first = message.split(" ", 1)[0]
    param = first if first in _SAMPLING_FIELDS else default_param
    return APIError(400, message, param=param)


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> APIError:
    status = exc.status
    if status == 404:
        return APIError(404, f"There is no endpoint {request.method} {request.path}.", code="not_found")
    if status == 405:
        allowed = exc.headers.get("Allow", "")
        return APIError(405, f"{request.path} does not take {request.method}; it takes {allowed}.",
                        code="method_not_allowed", headers={"Allow": allowed})
    if status == 413:
        # NOTE: raised by aiohttp itself while reading a body over client_max_size.
        return APIError(413, f"Request body too large: {exc.text}", code="request_too_large")
    return APIError(status, exc.text or exc.reason)


def error_middleware(shapes: dict[str, object] | None = None):
    """Sends every error as OpenAI's ``{"error": {...}}``, or on a path under a prefix of
    ``shapes`` in that API's shape (``shapes[prefix](error) -> body``); logs unexpected ones."""
    shapes = shapes or {}

    def respond(request: web.Request, error: APIError) -> web.Response:
        for prefix, shape in shapes.items():
            if request.path == prefix or request.path.startswith(prefix + "/"):
                return web.Response(status=error.status, body=orjson.dumps(shape(error)),
                                    content_type="application/json", headers=error.headers)
        return error.to_response()

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as exc:
            return respond(request, exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return respond(request, _from_http_exception(request, exc))
        except Exception:  # noqa: BLE001 - a bug must still answer in the API's shape
            logger.exception("unhandled error in %s %s", request.method, request.path)
            return respond(request, APIError(500, "Internal server error; see the server log.",
                                             code="internal_error"))

    return middleware
