"""One generation's token bookkeeping, shared by single decoding (generate.py `Engine.tokens`)
and batched decoding (batch.py `Sequence`): sampling with its generator, the grammar's mask
and the repetition history, and the finish checks in their one order — a stop token, then
max_tokens, then a context that is full and cannot shift. A sequence decodes the same
tokens alone or in a batch because both ask this object, not two copies of it.
"""
from __future__ import annotations

import torch

from .grammar import Grammar
from .sampling import SamplingParams, sample


class Decoding:
    """The sampling state of one generation over `prompt` (history starts as the prompt)."""

    def __init__(self, prompt: list[int], max_tokens: int, params: SamplingParams,
                 stop_ids: set[int], grammar: Grammar | None = None):
        self.max_tokens, self.params, self.stop_ids = max_tokens, params, stop_ids
        self.gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.grammar = grammar.start() if grammar is not None else None   # a per-generation state
        self.history = list(prompt)
        self.n = 0                                      # tokens sampled

    def sample(self, logits: torch.Tensor) -> int:
        """The next token from next-token logits (V,), among those the grammar allows;
        recorded in the history and the grammar."""
        allowed = self.grammar.allowed() if self.grammar is not None else None
        tok = sample(logits, self.params, self.history, self.gen, allowed)
        if self.grammar is not None:
            self.grammar.accept(tok)
        self.history.append(tok)
        self.n += 1
        return tok

    def finish_reason(self, tok: int, engine) -> str | None:
        """Why the generation ends at `tok`, just sampled ("stop", "length", "context"), or
        None when the next forward is to feed it. `engine` holds the sequence's cache."""
        if tok in self.stop_ids:
            return "stop"
        if self.n == self.max_tokens:
            return "length"
        if len(engine.cached) >= engine.max_ctx and not engine.can_shift:
            return "context"
        return None
