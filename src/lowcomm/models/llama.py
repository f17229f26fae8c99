"""A small Llama-style decoder: RMSNorm, rotary positions, grouped-query attention, a SwiGLU MLP,
no biases and an untied output layer (Touvron et al. 2023; Llama 2/3's architecture).

It exists so that what a Llama-style layer keeps for backward can be measured
(``lowcomm plan --validate memory``, :mod:`lowcomm.plan.measure`), with the two ways the field
runs its elementwise parts:

* ``kernels="eager"``: plain PyTorch, as torchtitan writes it: :class:`torch.nn.RMSNorm` and
  ``F.silu(w1(x)) * w3(x)``. Autograd saves, per layer, the RMSNorm's input and its normalised
  input (for the scale's gradient) and, in the MLP, the gate's pre-activation, its SiLU, the up
  projection and their product: ``4 s b f`` elements.
* ``kernels="fused"``: one autograd node each, saving what a fused kernel saves (Megatron-LM's
  ``bias_swiglu`` and Transformer Engine's / Apex's fused RMSNorm): the RMSNorm's input and its
  reciprocal RMS, and SwiGLU's two inputs; with the product saved by the down projection,
  ``3 s b f`` elements.

The two compute the same function and the same gradients (``tests/test_plan.py`` checks it in
fp64). The constructor, the forward's ``(logits, loss)`` and ``blocks`` follow
:class:`~lowcomm.models.gpt.GPT`. Initialisation: normal(0, 0.02) for every linear and embedding
weight, ones for the norms' scales; deterministic given the global torch RNG state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Llama", "LlamaConfig"]

Kernels = Literal["eager", "fused"]


@dataclass(kw_only=True)
class LlamaConfig:
    """Shape of a :class:`Llama`."""

    vocab_size: int
    block_size: int = 128
    """Longest sequence (the rotary tables' length)."""
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention); None: ``n_head``."""
    n_embd: int = 128
    ffn_hidden: int | None = None
    """SwiGLU width; None: Llama's 2/3 · 4h rounded up to a multiple of 64."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    kernels: Kernels = "eager"
    """"eager" (plain PyTorch) or "fused" (what fused kernels save); see the module docstring."""

    def __post_init__(self) -> None:
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{key} must be an integer >= 1, got {value!r}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be n_head ({self.n_head}) times an even head size"
            )
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_head")
        if self.kernels not in ("eager", "fused"):
            raise ValueError(f"kernels must be 'eager' or 'fused', got {self.kernels!r}")

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return 64 * -(-(8 * self.n_embd // 3) // 64)


class _FusedRMSNorm(torch.autograd.Function):
    """y = x · rsqrt(mean(x²) + ε) · w, saving x and the reciprocal RMS only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return x * rstd * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, rstd, weight = ctx.saved_tensors
        normed = x * rstd
        grad_w = (grad * normed).reshape(-1, x.shape[-1]).sum(0)
        gw = grad * weight
        dot = (gw * x).mean(-1, keepdim=True)
        grad_x = rstd * gw - x * rstd.pow(3) * dot
        return grad_x, grad_w, None


class _FusedSwiGLU(torch.autograd.Function):
    """silu(a) · u, saving a and u only (the product's SiLU is recomputed in backward)."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, u)
        return F.silu(a) * u

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, u = ctx.saved_tensors
        sig = torch.sigmoid(a)
        silu = a * sig
        return grad * u * sig * (1 + a * (1 - sig)), grad * silu


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: Kernels) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels == "fused":
            out = _FusedRMSNorm.apply(x, self.weight, self.eps)
            assert isinstance(out, torch.Tensor)
            return out
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv = config.n_head, config.kv_heads
        self.head = config.n_embd // config.n_head
        kv = self.n_kv * self.head
        self.wq = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.wk = nn.Linear(config.n_embd, kv, bias=False)
        self.wv = nn.Linear(config.n_embd, kv, bias=False)
        self.wo = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv, self.head).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv, self.head).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        grouped = self.n_kv < self.n_head
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class FeedForward(nn.Module):
    """w2(silu(w1 x) · w3 x)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.n_embd, config.ffn, bias=False)
        self.w3 = nn.Linear(config.n_embd, config.ffn, bias=False)
        self.w2 = nn.Linear(config.ffn, config.n_embd, bias=False)
        self.kernels = config.kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels == "fused":
            hidden = _FusedSwiGLU.apply(self.w1(x), self.w3(x))
            assert isinstance(hidden, torch.Tensor)
        else:
            hidden = F.silu(self.w1(x)) * self.w3(x)
        return self.w2(hidden)


class LlamaBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.n_embd, config.norm_eps, config.kernels)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.n_embd, config.norm_eps, config.kernels)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Decoder-only Llama-style language model; ``forward(idx, targets)`` returns
    ``(logits, loss)`` as :class:`~lowcomm.models.gpt.GPT` does."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.norm_eps, config.kernels)
        self.output = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        head = config.n_embd // config.n_head
        freqs = config.rope_theta ** (-torch.arange(0, head, 2, dtype=torch.float64) / head)
        angles = torch.outer(torch.arange(config.block_size, dtype=torch.float64), freqs)
        angles = torch.cat((angles, angles), dim=-1)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if idx.dim() != 2:
            raise ValueError(
                f"Llama.forward expects idx of shape (batch, time), got {tuple(idx.shape)}"
            )
        T = idx.shape[1]
        if self.config.block_size < T:
            raise ValueError(
                f"Sequence length {T} exceeds block_size={self.config.block_size}: crop the input "
                "or build the model with a larger block_size."
            )
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.tok_embeddings(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.output(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
