"""Plain-PyTorch model definitions whose attention calls a pluggable backend."""

from baton_engine.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
