"""The API call's server span (tracing on only): one per ``/v1/*`` request, the root of its trace.

A pure ASGI middleware, so that with tracing off nothing is added to the app at all. It continues the client's W3C
``traceparent`` header, names the call by method and path, and covers validation, every choice's route span
(cluster/routing/router.py, under ``REQUEST_SPAN``) and the response until its last byte (a stream's too). A status
of 400 and over marks it as an error with that status.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from worker.tracing import REQUEST_SPAN, Tracing, mark_error


class TraceRequests:
    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app, self.tracing = app, tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        parent = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"traceparent"), None)
        method = scope.get("method", "")
        span = self.tracing.start(
            f"{method} {path}", parent, {"http.request.method": method, "url.path": path}, kind="server"
        )
        status = 0

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                span.set_attribute("http.response.status_code", status)
            await send(message)

        token = REQUEST_SPAN.set(span)
        try:
            await self.app(scope, receive, send_and_note)
        except BaseException as exc:
            mark_error(span, "internal_error", f"{type(exc).__name__}: {exc}")
            raise
        finally:
            REQUEST_SPAN.reset(token)
            if status >= 400:
                mark_error(span, f"http_{status}", f"answered {status}")
            span.end()
