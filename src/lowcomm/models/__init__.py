"""Models trained by lowcomm: a small GPT for the ``lowcomm train`` job."""

from lowcomm.models.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "GPTConfig"]
