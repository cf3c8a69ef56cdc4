"""How a request fails at the router: each error carries the HTTP status and OpenAI error code the client sees."""

from __future__ import annotations


class RequestFailed(Exception):
    status = 500
    code = "internal_error"

    def __init__(self, message: str, code: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code or self.code
        self.status = status or self.status


class Overloaded(RequestFailed):
    status, code = 429, "overloaded"


class NoWorkers(RequestFailed):
    status, code = 503, "no_workers"


class ScaleError(ValueError):
    """A scale request that cannot be done as asked; ``param`` names the field (the API answers 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
