"""kvrun — an LLM decoding runtime with a compressed KV-cache arena.

Public API: `load`, `Model`, `ModelConfig`, `SamplingParams`, `StreamEvent`, `Timings`,
`KvrunError`. They are imported on first use (PEP 562), so `import kvrun` — and every
`kvrun` command's start, `--help` included — does not load torch until a command needs it.
"""
from importlib import import_module

from .errors import KvrunError

_WHERE = {"Model": ".engine.api", "load": ".engine.api", "ModelConfig": ".model.config",
          "StreamEvent": ".engine.generate", "Timings": ".engine.generate",
          "SamplingParams": ".engine.sampling"}

__all__ = ["KvrunError", "Model", "ModelConfig", "SamplingParams", "StreamEvent", "Timings", "load"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(import_module(_WHERE[name], __name__), name)
        globals()[name] = value                 # once: later lookups are plain attributes
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
