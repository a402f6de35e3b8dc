"""The gateway's one error type and its OpenAI-style body.

Every failure a client should see becomes a :class:`GatewayError` carrying the HTTP status; the
server turns it into ``{"error": {"message", "type", "param", "code"}}`` as vLLM does (``type`` is
the error class name, ``code`` the HTTP status), so clients switching from vLLM see the same body.
"""

from __future__ import annotations

from http import HTTPStatus

from baton_gateway.protocol import ErrorInfo, ErrorResponse

# HTTP status -> the ``type`` of the error body (vLLM's / the OpenAI SDK's exception names).
_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.TOO_MANY_REQUESTS: "RateLimitError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.NOT_IMPLEMENTED: "NotImplementedError",
    HTTPStatus.BAD_GATEWAY: "BadGatewayError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
    HTTPStatus.GATEWAY_TIMEOUT: "GatewayTimeoutError",
}


class GatewayError(Exception):
    """A failure answered to the client with ``status`` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param

    def to_response(self) -> ErrorResponse:
        return error_response(self.status, self.message, self.param)


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(HTTPStatus.BAD_REQUEST, message, param)


def error_response(status: int, message: str, param: str | None = None) -> ErrorResponse:
    """The OpenAI-style body for ``status``."""
    try:
        err_type = _ERROR_TYPES.get(HTTPStatus(status), HTTPStatus(status).phrase)
    except ValueError:
        err_type = "Error"
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status))
