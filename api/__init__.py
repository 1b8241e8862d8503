"""kvrun — an LLM decoding runtime with a compressed KV-cache arena.

Public API: `load`, `Model`, `ModelConfig`, `SamplingParams`, `StreamEvent`, `KvrunError`.
"""
from kvrun.runtime.api import Model, load
from kvrun.runtime.config import ModelConfig
from kvrun.runtime.errors import KvrunError
from kvrun.runtime.generate import StreamEvent, Timings
from kvrun.runtime.sampling import SamplingParams

__all__ = ["KvrunError", "Model", "ModelConfig", "SamplingParams", "StreamEvent", "Timings", "load"]
__version__ = "0.1.0"
