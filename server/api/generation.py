"""The engine requests one HTTP request owns (`Generation`): submitted together, consumed together,
cancelled together on a disconnect or a deadline."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request

from model.config import ContextLengthError, PromptError
from model.sampling import SamplingParams
from server.api.engine_client import EngineClient
from server.api.errors import APIError
from server.api.metrics import Metrics
from server.engine import FINISH_ABORT, FINISH_ERROR, AsyncSink, EngineStoppedError, QueueFullError, TokenOutput


class Generation:
    """The engine requests one HTTP request owns: for each prompt, its copies (n, best_of), choice k
    being copy k % copies of prompt k // copies. All are submitted at construction (so a refusal is an
    HTTP status, not a broken stream), consumed together by `events`, and cancelled together when the
    client disconnects or when `timeout` seconds have passed (then each one's last event is an error of
    type 'timeout')."""

    def __init__(
        self,
        engine: EngineClient,
        metrics: Metrics,
        prompts: list[list[int]],
        params: list[SamplingParams],
        use_cache: bool,
        *,
        timeout: float | None = None,
        max_tokens_field: str = "max_new_tokens",
        cache_salt: str | None = None,
        speculative: bool = True,
    ) -> None:
        """params: one per copy of each prompt (the same list for every prompt)."""
        self.engine, self.metrics, self.prompts, self.params, self.use_cache = (
            engine,
            metrics,
            prompts,
            params,
            use_cache,
        )
        self.timeout, self.expired = timeout, False
        self.max_tokens_field = max_tokens_field  # the request's name for max_new_tokens, in refusals
        loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout if timeout else None  # from the request's arrival, admission included
        self.copies = len(params)
        _check_fits_queue(engine, len(prompts), self.copies)
        self._events: asyncio.Queue = asyncio.Queue()
        sink = AsyncSink(loop, self._events)
        self.request_ids: list[str] = []
        try:
            for ids in prompts:
                if self.copies == 1:
                    self.request_ids.append(
                        engine.submit(
                            ids, params[0], sink, use_cache=use_cache, cache_salt=cache_salt, speculative=speculative
                        )
                    )
                else:
                    self.request_ids += engine.submit_copies(
                        ids,
                        params,
                        [sink] * self.copies,
                        use_cache=use_cache,
                        cache_salt=cache_salt,
                        speculative=speculative,
                    )
        except (PromptError, QueueFullError, EngineStoppedError) as e:
            self.cancel()
            raise self._refusal(e) from e
        self._choice = {rid: k for k, rid in enumerate(self.request_ids)}
        self._open = set(self.request_ids)

    async def admitted(self) -> None:
        """Returns once the engine has taken the requests. The local engine took them in `submit` (or
        refused there); an engine in other processes (the cluster's replicas) answers later, and its
        refusal becomes the same HTTP status here, before a response has started."""
        if self.engine.info.in_process:
            return
        try:  # the deadline covers the wait in the replicas' queue too (none may be running)
            await asyncio.wait_for(self.engine.admitted(self.request_ids), self._remaining())
        except (PromptError, QueueFullError, EngineStoppedError) as e:  # a replica's own checks (KV cache size)
            self.cancel()
            raise self._refusal(e) from e
        except asyncio.TimeoutError:
            self.cancel()
            raise APIError(
                504,
                f"no replica took the request within its deadline of {self.timeout:g} s "
                "(parameters.timeout / --request-timeout)",
                "timeout",
                reason="timeout",
            ) from None

    def _remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - asyncio.get_running_loop().time())

    @property
    def done(self) -> bool:
        return not self._open

    def has_ready(self) -> bool:
        """`events` would give its next pair, or end, without waiting: events have arrived that it has not
        taken yet, or every choice has its last one."""
        return not self._events.empty() or not self._open

    def cancel(self) -> None:
        for rid in getattr(self, "_open", self.request_ids):
            self.engine.abort(rid)

    async def events(self, request: Request) -> AsyncIterator[tuple[int, TokenOutput]]:
        """(choice, event) pairs as they arrive, until every choice has its last event."""
        watcher = asyncio.ensure_future(self._cancel_on_disconnect(request))
        deadline = asyncio.get_running_loop().call_at(self._deadline, self._expire) if self._deadline else None
        previous: dict[int, TokenOutput] = {}
        try:
            while self._open:
                out = await self._events.get()
                k = self._choice[out.request_id]
                if out.token_id is not None:
                    self.metrics.on_token(out, previous.get(k), self.use_cache)
                if out.finished:
                    self._open.discard(out.request_id)
                    if self.expired and out.finish_reason == FINISH_ABORT:  # counted as an error, not an abort
                        out = replace(
                            out,
                            finish_reason=FINISH_ERROR,
                            error_type="timeout",
                            error=(
                                f"the request ran past its deadline of {self.timeout:g} s "
                                "(parameters.timeout / --request-timeout)"
                            ),
                        )
                    self.metrics.on_finish(
                        out.finish_reason, len(self.prompts[k // self.copies]), out.stats, self.use_cache
                    )
                previous[k] = out
                yield k, out
        finally:
            watcher.cancel()
            if deadline is not None:
                deadline.cancel()
            if self._open:  # the consumer left early: the client is gone
                for rid in self._open:
                    self.engine.abort(rid)
                    prompt = self.prompts[self._choice[rid] // self.copies]
                    self.metrics.on_finish(FINISH_ABORT, len(prompt), None, self.use_cache)
                self._open.clear()

    async def collect(self, request: Request) -> list[list[TokenOutput]]:
        """Every choice's events, in choice order; a failed or cancelled choice is an APIError."""
        outs: list[list[TokenOutput]] = [[] for _ in self.request_ids]
        async for k, out in self.events(request):
            outs[k].append(out)
        for events in outs:
            final = events[-1]
            if final.finish_reason == FINISH_ERROR:
                raise APIError.of_failed_generation(final.error_type, final.error)
            if final.finish_reason == FINISH_ABORT:
                raise APIError(503, "the request was cancelled", "cancelled")
        return outs

    async def _cancel_on_disconnect(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.cancel()

    def _expire(self) -> None:
        if self._open:
            self.expired = True
            self.metrics.on_rejected("timeout")
            self.cancel()

    def _refusal(self, e: PromptError | QueueFullError | EngineStoppedError) -> APIError:
        """A request the engine did not take, as its HTTP status."""
        if isinstance(e, PromptError):
            overflow = isinstance(e, ContextLengthError)
            return APIError(
                422,
                str(e).replace("max_new_tokens", self.max_tokens_field),
                "validation",
                reason="context_length" if overflow else "validation",
                code="context_length_exceeded" if overflow else None,
            )
        if isinstance(e, QueueFullError):
            return APIError(429, str(e), "overloaded", headers={"Retry-After": "1"}, reason="queue_full")
        return APIError(503, str(e), "unavailable", headers={"Retry-After": "5"}, reason="shutting_down")


def tokens_of(outs: list[TokenOutput]) -> list[TokenOutput]:
    """A choice's token events (a scored prompt's only event carries none)."""
    return [o for o in outs if o.token_id is not None]


def _check_fits_queue(engine: EngineClient, prompts: int, copies: int) -> None:
    """A request whose sequences exceed what the engine ever holds at once (running and waiting) is a 422,
    never a 429 that no retry can turn into a success. An engine in other processes (the cluster) takes
    each prompt on a replica of its own choosing: there, one prompt's copies must fit one replica."""
    capacity = engine.config.max_num_seqs + engine.config.max_waiting
    asked = copies * (prompts if engine.info.in_process else 1)
    if asked > capacity:
        what = (
            f"{prompts} prompt(s) × {copies} cop{'y' if copies == 1 else 'ies'}"
            if prompts > 1
            else f"{copies} copies of its prompt (n, best_of)"
        )
        raise APIError(
            422,
            f"the request asks for {asked} sequences at once ({what}); this server holds at most "
            f"{capacity} (--max-num-seqs + --max-waiting)",
            "validation",
            reason="sequences",
        )
