"""Models trained by lowcomm: a small GPT for the ``lowcomm train`` job, and a small Llama-style
decoder whose activation memory ``lowcomm plan --validate memory`` measures."""

from lowcomm.models.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig
from lowcomm.models.llama import Llama, LlamaConfig

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "GPTConfig", "Llama", "LlamaConfig"]
