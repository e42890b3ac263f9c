"""Errors as the OpenAI API shapes them: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

# The error type OpenAI's API names for each status (the client picks its exception by status).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 421: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "server_error"}


class APIError(Exception):
    """A request the server answers with an error status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
