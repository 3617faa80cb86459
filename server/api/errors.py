"""The two error shapes: TGI's on its routes, OpenAI's on /v1/, where OpenAI's clients read it."""
from __future__ import annotations


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/")


def error_body(status: int, message: str, error_type: str, openai: bool) -> dict:
    """TGI's {"error": message, "error_type": type}, or OpenAI's {"error": {"message", "type", "param", "code"}}."""
    if openai:
        return {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    return {"error": message, "error_type": error_type}
