"""The window write's torch implementation (kvrun.kernels.window_write, the Triton kernels'
oracle: test_triton_window_write.py): K rows get the model's RoPE, V rows its projection,
both rounded to the window's dtype at slots [w, w + T) and nowhere else; a write past the
window is refused."""
import pytest
import torch

from kvrun.kernels.rope import Rope, apply_rope
from kvrun.kernels.window_write import write_k, write_rows, write_v


def _window(Hkv=2, slots=8, D=16, dtype=torch.float16):
    return torch.full((Hkv, slots, D), 7.0, dtype=dtype)


def test_write_k_is_the_models_rope_rounded_to_the_window():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 16, generator=g)                      # (Hkv, T, D)
    cos, sin = Rope(16, 1e4, None, 32).tables(torch.arange(4, 7), torch.float32)
    win = _window()
    write_k(x, cos, sin, win, 2)
    assert torch.equal(win[:, 2:5], apply_rope(x[None], cos, sin)[0].half())
    assert torch.all(win[:, :2] == 7) and torch.all(win[:, 5:] == 7)


def test_write_v_projects_or_takes_the_rows():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 12, generator=g)                         # (T, hidden)
    w, b = torch.randn(2 * 16, 12, generator=g), torch.randn(2 * 16, generator=g)
    win = _window(dtype=torch.float32)
    write_v(x, w, b, win, 5)
    want = (x @ w.T + b).view(3, 2, 16).transpose(0, 1)          # (Hkv, T, D)
    torch.testing.assert_close(win[:, 5:8], want)
    rows = torch.randn(2, 2, 16, generator=g)
    write_v(rows, None, None, win, 0)
    assert torch.equal(win[:, :2], rows) and torch.all(win[:, 2:5] == 7)


def test_a_write_past_the_window_is_refused():
    with pytest.raises(ValueError, match="window write: 6 \\+ 3 tokens > 8 window slots"):
        write_rows(torch.zeros(2, 3, 16), _window(), 6)
