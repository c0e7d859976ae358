"""OpenAI error objects: `{"error": {"message", "type", "param", "code"}}`.

Every failure the server reports goes through `APIError`, so a client sees the
same shape for a bad field, a missing key, an unknown model or a full queue,
and never a stack trace.
"""

from __future__ import annotations

from pydantic import ValidationError

from medusa.decoding.server.protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "internal_server_error")
        return ErrorResponse(error=ErrorInfo(message=self.message, type=kind, param=self.param,
                                             code=self.code)).model_dump()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def unsupported(param: str, why: str) -> APIError:
    return APIError(400, f"{param} is not supported by this server: {why}", param, "unsupported_parameter")


def from_validation(err: ValidationError) -> APIError:
    """A readable 400 from pydantic's errors, naming the field but never echoing the input."""
    problems = err.errors(include_url=False, include_input=False, include_context=False)
    if problems and problems[0]["type"] == "json_invalid":
        return bad_request(f"the body is not valid JSON: {problems[0]['msg']}", code="invalid_json")
    parts = [f"{_where(p['loc'])}: {p['msg']}" if p["loc"] else p["msg"] for p in problems[:3]]
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    param = str(problems[0]["loc"][0]) if problems and problems[0]["loc"] else None
    return bad_request("; ".join(parts) + more, param)


def _where(loc: tuple) -> str:
    # union members add their type name to the location ("prompt.list[int].0"): keep the field path only
    return ".".join(str(part) for part in loc if not _is_type_name(part))


def _is_type_name(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))
