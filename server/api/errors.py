"""The two error shapes (TGI's on its routes; OpenAI's on /v1/ and vLLM's tokenizer routes, where OpenAI's
clients read it) and `APIError`, the exception a route raises to answer one of them."""

from __future__ import annotations

from fastapi.responses import JSONResponse

ERROR_STATUS = {"shutdown": 503, "timeout": 504, "overloaded": 429}  # a failed generation's error_type; else 500
FAILED_GENERATION = 424  # TGI's status for its GenerationError (Failed Dependency), where OpenAI's routes answer 500


VLLM_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")  # vLLM's, outside /v1/, answered as vLLM does


def route_path(scope) -> str:
    """The request's path below the app's mount point (`root_path`: a Serve route prefix such as /rr), the
    path the routes are declared with."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def is_openai_path(path: str) -> bool:
    """OpenAI's routes and vLLM's tokenizer routes answer errors in OpenAI's shape."""
    return path.startswith("/v1/") or path in VLLM_ROUTES


def openai_status(status: int) -> int:
    """OpenAI (and vLLM) answer a request they cannot take with 400, which OpenAI's SDKs raise as
    BadRequestError, the class clients catch (a context overflow among them); TGI answers 422."""
    return 400 if status == 422 else status


def tgi_status(status: int, error_type: str) -> int:
    """TGI answers a generation that failed (error_type 'generation': non-finite logits, a replica lost
    mid-request) with 424, which huggingface_hub raises as GenerationError; an unexpected error stays 500."""
    return FAILED_GENERATION if status == 500 and error_type == "generation" else status


def openai_type(status: int) -> str:
    """OpenAI's error `type` for a status: its clients branch on it, and on `code`, not on the message."""
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str, error_type: str, openai: bool, code: str | None = None) -> dict:
    """TGI's {"error": message, "error_type": type}, or OpenAI's {"error": {"message", "type", "param", "code"}}:
    there `type` is OpenAI's class of the error, `code` OpenAI's own code where it has one
    (context_length_exceeded, model_not_found, invalid_api_key), else this server's `error_type`."""
    if openai:
        return {"error": {"message": message, "type": openai_type(status), "param": None, "code": code or error_type}}
    return {"error": message, "error_type": error_type}


class APIError(Exception):
    """An answer other than 200, in TGI's shape: {"error": ..., "error_type": ...}. `reason`, when set,
    counts it in /metrics as a refusal (kvserve:request_rejected_total{reason=...})."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str,
        headers: dict[str, str] | None = None,
        reason: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.error_type, self.headers = status, message, error_type, headers
        self.reason, self.code = reason, code  # code: OpenAI's name for this error, where it has one

    def response(self, openai: bool = False) -> JSONResponse:
        """TGI's {"error": message, "error_type": type}, or with `openai` OpenAI's
        {"error": {"message", "type", "param", "code"}} and status (400 for TGI's 422), which its clients read."""
        status = openai_status(self.status) if openai else tgi_status(self.status, self.error_type)
        return JSONResponse(
            error_body(status, self.message, self.error_type, openai, self.code),
            status_code=status,
            headers=self.headers,
        )

    @classmethod
    def of_failed_generation(cls, error_type: str | None, message: str | None) -> APIError:
        """A generation that ended in error: 504 for its deadline, 503 for a shutdown, else 500 (424 on TGI's
        routes: `tgi_status`)."""
        error_type = error_type or "generation"
        status = ERROR_STATUS.get(error_type, 500)
        return cls(
            status, message or "generation failed", error_type, headers={"Retry-After": "1"} if status == 429 else None
        )
