"""The velocity engine: paged KV cache, continuous batching, per-request ChatTTS sampling."""

from .async_engine import AsyncLLMEngine, AsyncStats, EngineShutdownError
from .engine_config import EngineConfig
from .llm_engine import EngineStats, LLMEngine
from .request_stream import RequestError, RequestStream, RequestTimes
from .sampling_params import Mode, SamplingParams
from .sequence import FinishReason, Prompt, RequestOutput
from .validation import validate_request

__all__ = ["AsyncLLMEngine", "AsyncStats", "EngineConfig", "EngineShutdownError", "EngineStats", "FinishReason",
           "LLMEngine", "Mode", "Prompt", "RequestError", "RequestOutput", "RequestStream", "RequestTimes",
           "SamplingParams", "validate_request"]
