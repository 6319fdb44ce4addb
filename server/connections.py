"""Connections: a cap on how many are open, and aiohttp's own HTTP errors in OpenAI's shape.

aiohttp answers a request it cannot parse (a header line over 8,190 bytes, a malformed
request line) itself, in plain text that may echo what it read; and it accepts every
connection. Pagoda's server subclass answers such errors with ``{"error": {...}}`` naming
no part of the request, and closes connections past ``--max-connections`` with a 503 at
once. How long a connection may take to send a whole request's headers is aiohttp's
``keepalive_timeout`` (``--header-timeout``), set through the app's handler arguments.

NOTE: aiohttp builds its ``Server`` in ``Application._make_handler``, which has no public
hook; :func:`harden` wraps that method on the one app instance. tests/test_server_limits.py
checks both behaviours, so an aiohttp release that changes this fails there.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

logger = logging.getLogger(__name__)


def _error_body(status: int, message: str, code: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                   else "server_error", "param": None, "code": code}})


class _RequestHandler(RequestHandler):
    """aiohttp's protocol, with its parse errors answered in OpenAI's JSON shape."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:
            logger.info("unparsable request from %s: %s", request.remote, type(exc).__name__ if exc else status)
        if request.writer.output_size > 0:
            raise ConnectionError("the response had started; cannot send an error")
        phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
        text = ("The server failed on this request; see the server log." if status >= 500 else
                f"The HTTP request could not be read ({phrase}): a malformed request line, or a header line or "
                "field over 8,190 bytes.")
        response = web.Response(status=status, body=_error_body(status, text, "invalid_http_request"),
                                content_type="application/json")
        response.force_close()
        return response


class _Server(web.Server):
    """aiohttp's connection manager, with a cap on open connections."""

    max_connections: int | None = None

    def __call__(self) -> RequestHandler:
        return _RequestHandler(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        limit = self.max_connections
        if limit is not None and len(self.connections) > limit:
            body = _error_body(503, f"Too many open connections (--max-connections {limit}). Retry later.",
                               "too_many_connections")
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                            b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            transport.close()


def harden(app: web.Application, max_connections: int | None) -> None:
    """Makes ``app``'s server the hardened one (see the module docstring)."""
    make_handler = app._make_handler

    def make_server(*args, **kwargs) -> web.Server:
        server = make_handler(*args, **kwargs)
        server.__class__ = _Server  # NOTE: a subclass that adds no state of its own
        server.max_connections = max_connections
        return server

    app._make_handler = make_server
