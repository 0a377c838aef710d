"""The velocity engine: paged KV cache, continuous batching, per-request ChatTTS sampling."""

from .config import EngineConfig
from .llm import LLM
from .llm_engine import LLMEngine
from .sampling_params import Mode, SamplingParams
from .sequence import FinishReason, Prompt, RequestOutput

__all__ = ["LLM", "EngineConfig", "FinishReason", "LLMEngine", "Mode", "Prompt", "RequestOutput", "SamplingParams"]
