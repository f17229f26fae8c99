"""Offline data and model for the trainer examples: a byte-level BPE tokenizer trained in-process
by ``tokenizers`` on text that ships with Python (its help topics, lowcomm's embedded corpus, or
your own ``--data``), the text cut into fixed-length token blocks, and the small Llama's config.
Nothing is downloaded.

Every process trains the same tokenizer from the same text (BPE training is deterministic), so
no file has to be shared between them.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig

from lowcomm.data import load_text


def train_tokenizer(text: str, vocab_size: int = 2048) -> Tokenizer:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens trained on ``text``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in text.splitlines() if line.strip()]
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


class TokenBlocks(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Consecutive blocks of ``block`` tokens, as ``{"input_ids", "labels"}`` (labels =
    inputs: the model shifts them)."""

    def __init__(self, ids: torch.Tensor, block: int) -> None:
        self.ids, self.block = ids, block

    def __len__(self) -> int:
        return len(self.ids) // self.block

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.ids[i * self.block : (i + 1) * self.block]
        return {"input_ids": x, "labels": x.clone()}


def text_datasets(
    data: str | None, *, block: int, vocab_size: int = 2048, val_fraction: float = 0.05
) -> tuple[Tokenizer, TokenBlocks, TokenBlocks]:
    """The tokenizer and the train and validation blocks of ``data`` (a text file or folder;
    ``None``: the text that ships with Python)."""
    text = load_text(data)
    tokenizer = train_tokenizer(text, vocab_size)
    ids = torch.tensor(tokenizer.encode(text).ids, dtype=torch.long)
    split = int(len(ids) * (1 - val_fraction))
    return tokenizer, TokenBlocks(ids[:split], block), TokenBlocks(ids[split:], block)


def small_llama(vocab_size: int, block: int) -> LlamaConfig:
    """A 0.9 M-parameter Llama (2 layers, width 128, grouped-query attention) for ``block``
    tokens: built from its config, nothing downloaded."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=block,
    )
