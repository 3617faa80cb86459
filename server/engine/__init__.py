"""The serving engine, one concept per module: request state (`request`), the block pool and prefix
cache (`block_manager`), the schedule (`scheduler`), the step's preallocated inputs (`input_buffers`),
its forward (`model_runner`), the pick (`sampler`), prompt logprobs (`prompt_scoring`), n-gram drafts
(`speculative`), output processing (`output_processor`), where events go (`sinks`), which prompts
fit and in what order they are read (`admission`), the rerun of a failed batch (`one_by_one`), warm-up
and calibration (`warmup`), the running totals (`counters`), what people inspect (`kv_view`,
`attention_rows`), one step schedule -> execute -> update over the pieces it owns (`core`), and the
engine that takes requests and runs those steps on a thread of its own (`engine`). No HTTP code here."""

from server.engine.config import EngineConfig, EngineInfo
from server.engine.engine import Engine, EngineArgs, EngineStoppedError
from server.engine.request import (
    FINISH_ABORT,
    FINISH_EOS,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    Request,
    RequestStats,
    TokenOutput,
)
from server.engine.scheduler import QueueFullError
from server.engine.sinks import AsyncSink

__all__ = [
    "AsyncSink",
    "Engine",
    "EngineArgs",
    "EngineConfig",
    "EngineInfo",
    "EngineStoppedError",
    "FINISH_ABORT",
    "FINISH_EOS",
    "FINISH_ERROR",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "QueueFullError",
    "Request",
    "RequestStats",
    "TokenOutput",
]
