"""Which `model` names a request may ask for (--served-model-name), and the rule for placeholders.

The rule: a request is served when its `model` is absent, one of the served names, or a placeholder
that clients send when their user gave no model at all (PLACEHOLDER_NAMES). Any other name gets vLLM's
404, so a name a user typed wrong is still caught. Answers name the first served name."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from server.api.errors import APIError

# huggingface_hub's InferenceClient(base_url=...) sends "dummy" when given no model; TGI's own examples
# send "tgi" (TGI ignores the name on its OpenAI route).
PLACEHOLDER_NAMES = frozenset({"dummy", "tgi"})


@dataclass(frozen=True)
class ServedNames:
    names: tuple[str, ...]  # --served-model-name, in order; the first is reported in answers and metrics

    def __post_init__(self) -> None:
        if not self.names or not all(self.names):
            raise ValueError(f"need at least one non-empty served model name, got {list(self.names)}")

    @classmethod
    def of(cls, names: str | Sequence[str]) -> ServedNames:
        return cls((names,) if isinstance(names, str) else tuple(names))

    @property
    def primary(self) -> str:
        return self.names[0]

    def check(self, requested: str | None) -> None:
        """A 404 for a name this server does not serve (see the module's rule)."""
        if requested is None or requested in self.names or requested in PLACEHOLDER_NAMES:
            return
        served = ", ".join(repr(n) for n in self.names)
        raise APIError(
            404, f"model {requested!r} does not exist; this server serves {served}", "not_found", code="model_not_found"
        )
