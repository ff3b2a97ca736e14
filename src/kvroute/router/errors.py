"""The router's one error tree (docs/architecture.md, convention 9).

Every failure the router reports to a client is a ``KvrouteError`` subclass carrying its
HTTP status, OpenAI error ``type`` and ``code``; one middleware (``router/app.py``) turns
it into ``{"error": {"message", "type", "param", "code"}}``. Leaves also subclass the matching
builtin (``TimeoutError``, ``ConnectionError``) so callers can catch at either level.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec


class KvrouteError(Exception):
    """Base of every error the router turns into an HTTP error response."""

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"
    code: ClassVar[str] = "internal_error"

    def __init__(
        self, message: str, *, headers: dict[str, str] | None = None, close: bool = False
    ) -> None:
        super().__init__(message)
        self.message = message
        # extra response headers, e.g. Retry-After on 429
        self.headers = headers or {}
        # the connection cannot carry another request (its body was not read to the end)
        self.close = close

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.code)


def error_body(message: str, error_type: str, code: str | int) -> dict[str, Any]:
    """The OpenAI error shape (``param``: the field at fault; the router names it in the
    message, as vLLM does, and sends null like OpenAI for the rest)."""
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


def error_bytes(message: str, error_type: str, code: str | int) -> bytes:
    return msgspec.json.encode(error_body(message, error_type, code))


class BadRequest(KvrouteError, ValueError):
    """400: the body is not JSON, not an object, or misses/mistypes a field."""

    status = 400
    error_type = "invalid_request_error"
    code = "bad_request"


class Unauthorized(KvrouteError):
    """401: missing or unknown API key."""

    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(KvrouteError):
    """403: the admin API is disabled (no admin key configured)."""

    status = 403
    error_type = "permission_error"
    code = "forbidden"


class NotFound(KvrouteError):
    """404: unknown path or resource."""

    status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    """404: no backend serves the requested model."""

    code = "model_not_found"


class MethodNotAllowed(KvrouteError):
    status = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"


class RequestTimeout(KvrouteError, TimeoutError):
    """408: the client did not send its whole request body in time (server.body_timeout_s)."""

    status = 408
    error_type = "invalid_request_error"
    code = "request_timeout"


class PayloadTooLarge(KvrouteError):
    status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class ExpectationFailed(KvrouteError):
    """417: an Expect header other than 100-continue (RFC 9110 section 10.1.1)."""

    status = 417
    error_type = "invalid_request_error"
    code = "expectation_failed"


class UnsupportedMediaType(KvrouteError):
    """415: the body comes in a content encoding the router cannot decode."""

    status = 415
    error_type = "invalid_request_error"
    code = "unsupported_content_encoding"


class RateLimited(KvrouteError):
    """429: a client key is over its concurrency or rate limit; carries Retry-After."""

    status = 429
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"


class BackendFailed(KvrouteError, ConnectionError):
    """502: every attempt failed (connect error, 5xx, reset) before any output."""

    status = 502
    error_type = "api_error"
    code = "backend_failed"


class BackendBusy(KvrouteError):
    """503: every backend tried answered 503 (it cannot take work now); carries
    Retry-After (the backend's, else 1 s), so clients back off instead of retrying at once."""

    status = 503
    error_type = "api_error"
    code = "backend_unavailable"


class NoHealthyBackend(KvrouteError):
    """503: no healthy, non-draining backend can take the request."""

    status = 503
    error_type = "api_error"
    code = "no_healthy_backend"


class BackendTimeout(KvrouteError, TimeoutError):
    """504: the backend did not answer within the first-byte or total timeout."""

    status = 504
    error_type = "api_error"
    code = "backend_timeout"
