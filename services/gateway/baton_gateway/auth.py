"""``--api-key``: every ``/v1`` request (and ``/invocations``, which serves the same work) must
carry ``Authorization: Bearer <key>``.

As in vLLM, only the OpenAI routes are protected; ``/health`` and ``/metrics`` stay open for
load balancers and Prometheus. A pure ASGI middleware, so streamed responses pass untouched.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from baton_gateway.errors import error_response


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    def authorized(self, scope: Scope) -> bool:
        path = scope["path"] if scope["type"] == "http" else ""
        if not (path.startswith("/v1") or path == "/invocations"):
            return True
        if scope.get("method") == "OPTIONS":  # CORS preflight carries no credentials
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                # Constant time, so the key cannot be guessed byte by byte from timings.
                return hmac.compare_digest(value, self._expected)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.authorized(scope):
            await self.app(scope, receive, send)
            return
        body = error_response(401, "invalid or missing API key").model_dump_json().encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
