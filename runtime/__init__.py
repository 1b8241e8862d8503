"""kvrun.runtime — config, model, tokenizer, sampling, generation, KV caches, API and CLI."""
