"""The velocity engine: paged KV cache, continuous batching, per-request ChatTTS sampling."""

from .async_engine import (
           AsyncLLMEngine,
           AsyncStats,
           EngineShutdownError,
           RequestError,
           RequestStream,
           RequestTimes,
)
from .config import EngineConfig
from .llm import LLM
from .llm_engine import EngineStats, LLMEngine
from .sampling_params import Mode, SamplingParams
from .sequence import FinishReason, Prompt, RequestOutput

__all__ = ["LLM", "AsyncLLMEngine", "AsyncStats", "EngineConfig", "EngineShutdownError", "EngineStats", "FinishReason",
           "LLMEngine", "Mode", "Prompt", "RequestError", "RequestOutput", "RequestStream", "RequestTimes",
           "SamplingParams"]
