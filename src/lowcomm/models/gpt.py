"""A small GPT (nanoGPT-style decoder-only transformer): the model the ``lowcomm train`` job uses.

It is deliberately small (about 1.24 M parameters with a byte-level vocabulary) so that several
data-parallel workers can train it on CPU in minutes, which is what the slow-link experiments
need: the point is to compare how communication strategies affect loss, not to train a good
language model. The defaults (6 layers, width 128) are near the cheapest shape above 1 M
parameters; a forward+backward of a 16 x 128 token batch is compute-bound (matmuls) at about
0.24 s on one CPU core, so the per-step cost scales with tokens per batch, not with the shape.

Layout: token + learned position embeddings, ``n_layer`` pre-LayerNorm :class:`Block` s kept
in ``GPT.blocks`` (an :class:`~torch.nn.ModuleList`, so callers can split parameters per
transformer block, e.g. to bucket communication block by block), a final LayerNorm and an LM
head whose weight is tied to the token embedding.

Initialisation is deterministic given the global torch RNG state (seed with
:func:`torch.manual_seed` before constructing), matching nanoGPT: normal(0, 0.02) for linear and
embedding weights, zero biases, and residual output projections scaled by
``1 / sqrt(2 * n_layer)`` so the residual stream variance does not grow with depth.

Example::

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256))
    logits, loss = model(x, targets=y)      # x, y: (batch, time) int64
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "Block", "CausalSelfAttention", "GPTConfig", "MLP", "Packed", "SplitAttention"]


@dataclass(kw_only=True)
class GPTConfig:
    """Shape and regularisation of a :class:`GPT`; defaults give ~1.24 M parameters at vocab 256."""

    vocab_size: int
    """Number of token ids the model embeds and predicts (256 for the byte tokenizer)."""
    block_size: int = 128
    """Context length: the longest sequence the position embedding covers."""
    n_layer: int = 6
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention and residual branches (0 disables it)."""
    bias: bool = True
    """Whether Linear and LayerNorm layers carry a bias."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            # bool is an int subclass; reject it so GPTConfig(n_layer=True) is not silently 1.
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"GPTConfig.{name}={value!r} is invalid: it must be a positive integer."
                )
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                f"choose n_embd as a multiple of n_head (e.g. n_embd="
                f"{self.n_head * max(1, round(self.n_embd / self.n_head))})."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(
                f"GPTConfig.dropout={self.dropout!r} is invalid: it must satisfy 0 <= dropout < 1."
            )


class SplitAttention(Protocol):
    """Causal attention over a document whose tokens are spread across ranks (this rank holds
    some of them): ``lowcomm.balance.RingAttention``."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of this rank's queries over the whole document's keys and values;
        ``q``, ``k``, ``v`` are ``(1, heads, local tokens, head size)``."""
        ...


@dataclass(frozen=True)
class Packed:
    """How a ``(1, time)`` input holds whole documents back to back (variable-length batches).

    Attention is block-diagonal causal: a token attends to the earlier tokens of its own
    document only, and every document's positions start at 0, so a document packed with
    others gives the same logits as alone. Attention runs per document, so its cost is
    ``sum(s**2)``, not ``(sum s)**2``.

    ``split`` instead marks the input as this rank's part of one document spread over several
    ranks (``positions`` then gives each token's position in the document).
    """

    lengths: Sequence[int]
    """Tokens of each document, in order; they sum to the input's length."""
    positions: torch.Tensor | None = None
    """Position of each token in its document (default: 0, 1, ... per document)."""
    split: SplitAttention | None = None
    """Attention across ranks for a split document (``lengths`` is then this rank's tokens)."""

    def position_ids(self, device: torch.device) -> torch.Tensor:
        if self.positions is not None:
            return self.positions.to(device)
        return torch.cat([torch.arange(n, dtype=torch.long, device=device) for n in self.lengths])


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through :func:`F.scaled_dot_product_attention`."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, packed: Packed | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        if packed is None or (packed.split is None and len(packed.lengths) == 1):
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        elif packed.split is not None:
            y = packed.split(q, k, v)
        else:  # block-diagonal causal: each document alone
            parts, start = [], 0
            for n in packed.lengths:
                end = start + n
                parts.append(
                    F.scaled_dot_product_attention(
                        q[:, :, start:end],
                        k[:, :, start:end],
                        v[:, :, start:end],
                        dropout_p=p,
                        is_causal=True,
                    )
                )
                start = end
            y = torch.cat(parts, dim=2)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(C, 4C) -> GELU -> Linear(4C, C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, packed: Packed | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), packed)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model with a weight-tied LM head.

    Attributes:
        config: the :class:`GPTConfig` it was built from.
        wte: token embedding, ``(vocab_size, n_embd)``; shared with ``lm_head.weight``.
        wpe: learned position embedding, ``(block_size, n_embd)``.
        blocks: the ``n_layer`` transformer :class:`Block` s, in order.
        ln_f: final LayerNorm.
        lm_head: output projection to vocabulary logits (no bias; weight is ``wte.weight``).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: one Parameter object, so parameters() yields it once and optimisers and
        # communication buckets see a single tensor.
        self.lm_head.weight = self.wte.weight

        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for block in self.blocks:
            assert isinstance(block, Block)
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.c_proj.weight, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self, *, exclude_position_embedding: bool = False) -> int:
        """Number of distinct parameters (the tied embedding/head weight counted once).

        Args:
            exclude_position_embedding: leave out ``wpe`` (nanoGPT's "non-embedding" count;
                the token embedding stays in because it doubles as the LM head).
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_position_embedding:
            n -= self.wpe.weight.numel()
        return n

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        packed: Packed | None = None,
        reduction: str = "mean",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute next-token logits and, given targets, the cross-entropy loss.

        Args:
            idx: ``(batch, time)`` int64 token ids, ``time <= block_size``.
            targets: optional ``(batch, time)`` int64 next-token ids.
            packed: ``idx`` (batch 1) holds several documents back to back, or one rank's
                part of a split document (:class:`Packed`).
            reduction: ``"mean"`` (over tokens) or ``"sum"`` of the per-token losses.

        Returns:
            ``(logits, loss)``: logits of shape ``(batch, time, vocab_size)``; loss a scalar
            tensor when ``targets`` is given, else ``None``.
        """
        if idx.dim() != 2:
            raise ValueError(
                f"GPT.forward expects idx of shape (batch, time), got {tuple(idx.shape)}: "
                "add a batch dimension with idx.unsqueeze(0)."
            )
        seq_len = idx.shape[1]
        if packed is None and seq_len > self.config.block_size:
            raise ValueError(
                f"Sequence length {seq_len} exceeds block_size={self.config.block_size}: "
                "crop the input or build the model with a larger block_size."
            )
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction={reduction!r} is invalid: use 'mean' or 'sum'.")
        if packed is None:
            pos = torch.arange(seq_len, dtype=torch.long, device=idx.device)
        else:
            _check_packed(packed, idx, self.config.block_size)
            pos = packed.position_ids(idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x, packed)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.reshape(-1), reduction=reduction
            )
        return logits, loss

    def zo_stages(
        self, idx: torch.Tensor, targets: torch.Tensor
    ) -> list[tuple[tuple[nn.Module, ...], Callable[[Any], Any]]]:
        """The loss of :meth:`forward` as stages, for zeroth-order steps that run each stage's
        two perturbed forwards back to back (``lowcomm.zo.MeZO(blockwise=True)``): the
        embeddings, each block, then the head (whose weight is the tied ``wte``) with the loss.
        The same operations as :meth:`forward`, so the same bits."""
        pos = torch.arange(idx.shape[1], dtype=torch.long, device=idx.device)

        def embed(_: Any) -> torch.Tensor:
            return self.drop(self.wte(idx) + self.wpe(pos))

        def head(x: torch.Tensor) -> torch.Tensor:
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

        blocks: list[tuple[tuple[nn.Module, ...], Callable[[Any], Any]]] = [
            ((block,), block) for block in self.blocks
        ]
        return [((self.wte, self.wpe), embed), *blocks, ((self.ln_f, self.lm_head), head)]


def _check_packed(packed: Packed, idx: torch.Tensor, block_size: int) -> None:
    if idx.shape[0] != 1:
        raise ValueError(
            f"A packed input has batch size 1 (documents back to back), got {idx.shape[0]}: "
            "concatenate the documents along time."
        )
    if sum(packed.lengths) != idx.shape[1] or any(n <= 0 for n in packed.lengths):
        raise ValueError(
            f"Packed lengths {list(packed.lengths)} must be positive and sum to the input's "
            f"{idx.shape[1]} tokens."
        )
    if packed.split is not None and packed.positions is None:
        raise ValueError(
            "A split document needs the position of each of this rank's tokens in it: pass "
            "Packed(positions=...) (lowcomm.balance.zigzag_positions)."
        )
    longest = max(packed.lengths)
    if packed.positions is not None:
        if packed.positions.shape != (idx.shape[1],):
            raise ValueError(
                f"Packed positions have shape {tuple(packed.positions.shape)}, expected "
                f"({idx.shape[1]},): one position per token."
            )
        longest = int(packed.positions.max()) + 1
    if longest > block_size:
        raise ValueError(
            f"A document of {longest} tokens exceeds block_size={block_size}: cap document "
            "lengths at block_size or build the model with a larger block_size."
        )
