"""What one request may ask of this server (the --max-* flags), checked by the routes."""

from __future__ import annotations

from dataclasses import dataclass

from model.sampling import MAX_LOGPROBS
from server.api.errors import APIError

# What a route generates when the request does not say (each capped by Limits.new_tokens): TGI's default,
# and OpenAI's for /v1/completions. Chat has none of its own: what the context leaves.
TGI_DEFAULT_MAX_NEW_TOKENS = 100
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class Limits:
    """What one request may ask of this server. Each refusal is a 4xx naming the flag that sets the limit
    and is counted in /metrics as kvserve:request_rejected_total{reason=...}."""

    max_body_bytes: int = 2_000_000  # --max-body-bytes: larger bodies get 413 before they are parsed
    max_input_tokens: int | None = None  # --max-input-tokens (after `truncate`); None: the context less one
    max_new_tokens: int | None = None  # --max-new-tokens; None: what the context leaves
    max_stop_sequences: int = 4  # --max-stop-sequences, as TGI
    max_stop_length: int = 256  # --max-stop-length, characters per stop string
    request_timeout: float | None = None  # --request-timeout seconds: the default deadline and the most one may ask
    max_n: int = 16  # --max-n: choices per prompt (OpenAI's n)
    max_best_of: int = 16  # --max-best-of: sequences generated per prompt to pick from (best_of)
    max_logprobs: int = MAX_LOGPROBS  # --max-logprobs: alternatives per token (logprobs, top_n_tokens, ...)
    max_prompts: int = 64  # --max-prompts: prompts in one completions request

    def deadline(self, requested: float | None) -> float | None:
        """Seconds this request may run: what it asked for, at most the server's limit."""
        given = [t for t in (requested, self.request_timeout) if t is not None]
        return min(given) if given else None

    def check_stop(self, stop: list[str], field: str) -> None:
        if len(stop) > self.max_stop_sequences:
            raise APIError(
                422,
                f"{field}: {len(stop)} stop sequences; this server takes at most "
                f"{self.max_stop_sequences} (--max-stop-sequences)",
                "validation",
                reason="stop_sequences",
            )
        longest = max(stop, key=len, default="")
        if len(longest) > self.max_stop_length:
            raise APIError(
                422,
                f"{field}: a stop sequence of {len(longest)} characters; this server takes at "
                f"most {self.max_stop_length} (--max-stop-length)",
                "validation",
                reason="stop_sequences",
            )

    def check_prompt(self, prompt_len: int) -> None:
        """--max-input-tokens only: what the model itself can run is checked by the engine (check_prompt)."""
        if self.max_input_tokens is not None and prompt_len > self.max_input_tokens:
            raise APIError(
                422,
                f"the prompt has {prompt_len} tokens; this server takes at most "
                f"{self.max_input_tokens} (--max-input-tokens)",
                "validation",
                reason="prompt_too_long",
                code="context_length_exceeded",
            )

    def new_tokens(
        self, requested: int | None, field: str, *, prompt_len: int, context_length: int, default: int | None
    ) -> int:
        """The most tokens a request may generate, by one rule on every route. Asked for: that number, a 422
        naming `field` above --max-new-tokens (past the context, the engine refuses it naming both lengths).
        Not asked for: the route's `default` (TGI_DEFAULT_MAX_NEW_TOKENS, COMPLETIONS_DEFAULT_MAX_TOKENS;
        None for chat), cut to what the context leaves after the prompt (the longest, for several) and to
        --max-new-tokens, and at least 1: a prompt that fills the context is then refused for its own length,
        not for a number of new tokens the client never sent."""
        if requested is not None:
            self.check_new_tokens(requested, field)
            return requested
        caps = (default, context_length - prompt_len, self.max_new_tokens)
        return max(1, min(c for c in caps if c is not None))

    def check_new_tokens(self, max_new_tokens: int, field: str) -> None:
        if self.max_new_tokens is not None and max_new_tokens > self.max_new_tokens:
            raise APIError(
                422,
                f"{field} ({max_new_tokens}) is above this server's limit of {self.max_new_tokens} (--max-new-tokens)",
                "validation",
                reason="max_new_tokens",
            )

    def check_count(self, field: str, value: int | None, limit_name: str) -> None:
        """n, best_of, logprobs and their kin against the flag of the same name."""
        limit = getattr(self, limit_name)
        if value is not None and value > limit:
            flag = "--" + limit_name.replace("_", "-")
            raise APIError(
                422,
                f"{field} ({value}) is above this server's limit of {limit} ({flag})",
                "validation",
                reason=limit_name.removeprefix("max_"),
            )
