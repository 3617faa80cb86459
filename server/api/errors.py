"""The two error shapes (TGI's on its routes; OpenAI's on /v1/ and vLLM's tokenizer routes, where OpenAI's
clients read it) and `APIError`, the exception a route raises to answer one of them."""
from __future__ import annotations

from fastapi.responses import JSONResponse

ERROR_STATUS = {"shutdown": 503, "timeout": 504, "overloaded": 429}  # a failed generation's error_type -> status; else 500


VLLM_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")  # vLLM's, outside /v1/, answered as vLLM does


def route_path(scope) -> str:
    """The request's path below the app's mount point (`root_path`: a Serve route prefix such as /rr), the
    path the routes are declared with."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def is_openai_path(path: str) -> bool:
    """OpenAI's routes and vLLM's tokenizer routes answer errors in OpenAI's shape."""
    return path.startswith("/v1/") or path in VLLM_ROUTES


def error_body(status: int, message: str, error_type: str, openai: bool) -> dict:
    """TGI's {"error": message, "error_type": type}, or OpenAI's {"error": {"message", "type", "param", "code"}}."""
    if openai:
        return {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    return {"error": message, "error_type": error_type}


class APIError(Exception):
    """An answer other than 200, in TGI's shape: {"error": ..., "error_type": ...}. `reason`, when set,
    counts it in /metrics as a refusal (kvserve:request_rejected_total{reason=...})."""

    def __init__(self, status: int, message: str, error_type: str, headers: dict[str, str] | None = None,
                 reason: str | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.headers = status, message, error_type, headers
        self.reason = reason

    def response(self, openai: bool = False) -> JSONResponse:
        """TGI's {"error": message, "error_type": type}, or with `openai` OpenAI's
        {"error": {"message", "type", "param", "code"}}, which its clients show."""
        return JSONResponse(error_body(self.status, self.message, self.error_type, openai), status_code=self.status,
                            headers=self.headers)

    @classmethod
    def of_failed_generation(cls, error_type: str | None, message: str | None) -> "APIError":
        """A generation that ended in error: 504 for its deadline, 503 for a shutdown, else 500."""
        error_type = error_type or "generation"
        return cls(ERROR_STATUS.get(error_type, 500), message or "generation failed", error_type)
