"""Baton's engine: paged KV cache, token-budget scheduler, model runner, sampler, offline API."""
