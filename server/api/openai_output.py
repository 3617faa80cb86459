"""What OpenAI's two routes (/v1/completions, /v1/chat/completions) answer alike: finish reasons and usage."""

from __future__ import annotations

from server.api.generation import tokens_of
from server.api.protocol_openai import CompletionTokensDetails, PromptTokensDetails, Usage
from server.engine import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, TokenOutput

OPENAI_FINISH = {FINISH_LENGTH: "length", FINISH_EOS: "stop", FINISH_STOP: "stop"}


def usage_so_far(prompt_tokens: int, generated: int) -> Usage:
    """One choice's usage in the middle of its stream (vLLM's continuous_usage_stats)."""
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=generated, total_tokens=prompt_tokens + generated)


def usage_of(
    prompts: list[list[int]],
    choices: list[list[TokenOutput]],
    copies: int,
    returned: list[list[TokenOutput]] | None = None,
) -> Usage:
    """Prompt tokens once per prompt (with what its first copy found in the prefix cache), and every
    returned choice's generated tokens: `returned`, the n kept of best_of's copies, when given (as vLLM
    counts them), else every one of `choices` (`copies` a prompt)."""
    prompt_tokens = sum(len(p) for p in prompts)
    kept = choices if returned is None else returned
    generated = sum(len(tokens_of(c)) for c in kept)
    cached = sum(
        choices[i * copies][-1].stats.cached_tokens
        for i in range(len(prompts))
        if choices[i * copies] and choices[i * copies][-1].stats
    )
    finals = [c[-1].stats for c in kept if c and c[-1].stats]
    accepted = sum(s.accepted_draft_tokens for s in finals)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=generated,
        total_tokens=prompt_tokens + generated,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        completion_tokens_details=CompletionTokensDetails(
            accepted_prediction_tokens=accepted,
            rejected_prediction_tokens=sum(s.draft_tokens for s in finals) - accepted,
        ),
    )
