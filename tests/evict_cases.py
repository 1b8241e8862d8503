"""Fixtures the eviction tests share (test_arena_evict.py, test_evict_policies.py,
test_arena_evict_compaction.py): one torch thread, and a tiny model of head dim 32."""
from __future__ import annotations

import pytest
import torch

from tiny import make_tiny_model_dir


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: thread start-up dominates, and the machine may be shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny32_dir(tmp_path_factory):
    """Head dim 32: the packed codecs need D a multiple of 32."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("ev32") / "tiny", hidden_size=128)
