"""kvrun — an LLM decoding runtime with a compressed KV-cache arena.

Public API: `load`, `Model`, `ModelConfig`, `SamplingParams`, `StreamEvent`, `KvrunError`.
"""
from .engine.api import Model, load
from .model.config import ModelConfig
from .errors import KvrunError
from .engine.generate import StreamEvent, Timings
from .engine.sampling import SamplingParams

__all__ = ["KvrunError", "Model", "ModelConfig", "SamplingParams", "StreamEvent", "Timings", "load"]
__version__ = "0.1.0"
