"""The transformers oracle's greedy continuation beside kvrun's, for the real-model tests
(test_smollm2.py, test_gemma3.py)."""
from __future__ import annotations

import torch


def greedy_pair(model, hf_model, prompt: list[int], n: int) -> tuple[list[int], list[int]]:
    """(kvrun's, transformers') n greedy tokens after `prompt`, neither stopping at EOS."""
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    model.stop_ids, stop = set(), model.stop_ids
    try:
        mine = [ev.token_id for ev in model.stream(prompt, n, temp=0) if ev.token_id is not None]
    finally:
        model.stop_ids = stop
    return mine, ref
