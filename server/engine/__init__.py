"""The serving engine, one concept per module: request state (`request`), the block pool and prefix
cache (`block_manager`), the schedule (`scheduler`), the step's preallocated inputs (`input_buffers`)
and its forward and sampling (`model_runner`), output processing (`output_processor`), and the
engine thread that runs schedule -> execute -> update (`engine`). No HTTP code here."""
from server.engine.config import EngineConfig
from server.engine.engine import AsyncSink, Engine, EngineArgs, EngineStoppedError, RequestStream
from server.engine.request import (FINISH_ABORT, FINISH_EOS, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, Request,
                                   RequestStats, TokenOutput)
from server.engine.scheduler import QueueFullError

__all__ = ["AsyncSink", "Engine", "EngineArgs", "EngineConfig", "EngineStoppedError", "FINISH_ABORT", "FINISH_EOS",
           "FINISH_ERROR", "FINISH_LENGTH", "FINISH_STOP", "QueueFullError", "Request", "RequestStats",
           "RequestStream", "TokenOutput"]
