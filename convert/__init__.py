"""Converters into kvrun's model directory format (convert/writer.py).

`convert_hf` reads an HF checkpoint folder (config.json + *.safetensors + tokenizer.json);
`convert_gguf` reads a llama.cpp GGUF file, keeping its weights' bits where kvrun's formats
allow (quantize.py) and rebuilding its tokenizer. Both validate every tensor against the
config and write atomically.
"""
from .gguf_file import convert_gguf
from .hf import convert_hf

__all__ = ["convert_gguf", "convert_hf"]


def _source(src):
    """('hf' | 'gguf', Path) for a conversion source, or a one-line KvrunError."""
    from pathlib import Path

    from kvrun.errors import KvrunError
    if not str(src).strip():
        raise KvrunError("the source path is empty")
    src = Path(src)
    if src.is_dir():
        return "hf", src
    if src.is_file():
        return "gguf", src
    if src.exists():                            # /dev/null, a FIFO: nothing to mmap
        raise KvrunError(f"{src}: not a regular file (expected a GGUF file or an HF folder)")
    raise KvrunError(f"{src}: no such file or directory")


def convert_any(src, out_dir, dtype: str | None = "bf16", progress=None, overwrite: bool = False,
                weights: str | None = None, group: int = 32, log=None):
    """Convert `src`: a folder is an HF checkpoint, a file a GGUF. `weights` float | int8 |
    int4 chooses how linear weights are stored (see quantize.py); None: float for an HF
    checkpoint, a GGUF's own bits (gguf_file.file_weights). `dtype` None: quantize.py
    `float_dtype` of the format."""
    from .quantize import float_dtype
    kw = dict(progress=progress, overwrite=overwrite, group=group, log=log)
    kind, src = _source(src)
    if kind == "hf":
        weights = weights or "float"
        return convert_hf(src, out_dir, dtype=dtype or float_dtype(weights), weights=weights, **kw)
    return convert_gguf(src, out_dir, dtype=dtype, weights=weights, **kw)


__all__ += ["convert_any"]
