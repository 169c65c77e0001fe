"""Reference models shared by the strategies: plain nn.Modules, parallelized from outside."""

from .gpt import GPT, GPTConfig, initial_value

__all__ = ["GPT", "GPTConfig", "initial_value"]
