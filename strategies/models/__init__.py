"""Reference models shared by the strategies: plain nn.Modules, parallelized from outside."""

from strategies.models.gpt import GPT, GPTConfig, initial_value

__all__ = ["GPT", "GPTConfig", "initial_value"]
