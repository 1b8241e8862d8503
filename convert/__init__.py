"""Converters into kvrun's model directory format (convert/writer.py).

`convert_hf` reads an HF checkpoint folder (config.json + *.safetensors + tokenizer.json);
`convert_gguf` reads a llama.cpp GGUF file, dequantizing its weights and rebuilding its
tokenizer. Both validate every tensor against the config and write atomically.
"""
from .gguf_file import convert_gguf
from .hf import convert_hf

__all__ = ["convert_gguf", "convert_hf"]


def convert_any(src, out_dir, dtype: str = "bf16", progress=None, overwrite: bool = False,
                weights: str = "float", group: int = 32, log=None):
    """Convert `src`: a folder is an HF checkpoint, a file a GGUF. `weights` float | int8 |
    int4 chooses how linear weights are stored (see quantize.py)."""
    kw = dict(dtype=dtype, progress=progress, overwrite=overwrite, weights=weights,
              group=group, log=log)
    from pathlib import Path

    from kvrun.errors import KvrunError
    if not str(src).strip():
        raise KvrunError("the source path is empty")
    src = Path(src)
    if src.is_dir():
        return convert_hf(src, out_dir, **kw)
    if src.is_file():
        return convert_gguf(src, out_dir, **kw)
    if src.exists():                            # /dev/null, a FIFO: nothing to mmap
        raise KvrunError(f"{src}: not a regular file (expected a GGUF file or an HF folder)")
    raise KvrunError(f"{src}: no such file or directory")


__all__ += ["convert_any"]
