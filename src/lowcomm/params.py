"""Trainable parameters: collecting them from a model or a list, splitting them into groups
(fragments) by transformer block, and loading saved copies into them (or into tensors shaped
like them) with errors that name the mismatch.

Example::

    named = collect_params(model)            # [(name, tensor), ...], requires_grad only
    groups = split_by_blocks(model, 4)       # block j -> group j mod 4
    load_tensors(state, "anchor", anchor)    # refuses another model's tensors
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["check_partition", "collect_params", "load_tensors", "split_by_blocks"]


def collect_params(
    model_or_params: nn.Module | Iterable[torch.Tensor],
) -> list[tuple[str, torch.Tensor]]:
    """The trainable parameters with their names (``params[i]`` when not from a module)."""
    named: list[tuple[str, torch.Tensor]]
    if isinstance(model_or_params, nn.Module):
        named = [(n, p) for n, p in model_or_params.named_parameters() if p.requires_grad]
    elif isinstance(model_or_params, torch.Tensor):
        raise ValueError(
            "model_or_params must be an nn.Module or an iterable of parameters, got a single "
            "tensor; wrap it in a list: [param]"
        )
    else:
        try:
            named = [(f"params[{i}]", p) for i, p in enumerate(model_or_params) if p.requires_grad]
        except (TypeError, AttributeError) as e:
            raise ValueError(
                f"model_or_params must be an nn.Module or an iterable of parameters, got "
                f"{type(model_or_params).__name__}"
            ) from e
    if not named:
        raise ValueError(
            "no trainable parameters: model_or_params has no tensor with requires_grad=True"
        )
    # FSDP2 (fully_shard) parameters are DTensors: work on this rank's local shard, which
    # shares their storage (ranks with the same place in their node groups hold matching
    # shards, so averaging those across node groups averages the model)
    named = [(n, _local(p)) for n, p in named]
    params = [p for _, p in named]
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(
            f"all parameters must be on one device, found {sorted(map(str, devices))}; "
            "pass the parameters of one device (one algorithm per device group)"
        )
    if any(not p.is_floating_point() for p in params):
        raise ValueError("all trainable parameters must be floating point")
    return named


def _local(param: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (same storage); any other tensor as it is."""
    to_local = getattr(param, "to_local", None)
    return to_local() if callable(to_local) else param


def load_tensors(state: dict[str, Any], key: str, into: Sequence[torch.Tensor]) -> None:
    """Copy ``state[key]`` (a list of tensors) into ``into``, refusing another model."""
    if state.get(key) is None:
        raise ValueError(f"outer state_dict is missing {key!r}")
    src = state[key]
    if len(src) != len(into):
        raise ValueError(
            f"state_dict[{key!r}] has {len(src)} tensors but the model has {len(into)} "
            "trainable parameters; load it into the same model"
        )
    for i, (s, d) in enumerate(zip(src, into)):
        if s.shape != d.shape:
            raise ValueError(
                f"state_dict[{key!r}][{i}] has shape {tuple(s.shape)} but parameter {i} "
                f"has shape {tuple(d.shape)}; load it into the same model"
            )
    torch._foreach_copy_(list(into), [s.to(d.device) for s, d in zip(src, into)])


def _find_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The ``nn.ModuleList`` with the most children: the transformer blocks of usual models."""
    best: nn.ModuleList | None = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and (best is None or len(module) > len(best)):
            best = module
    return best


def split_by_blocks(model: nn.Module, num_fragments: int) -> list[list[torch.Tensor]]:
    """Automatic fragments, strided by transformer block as in the Streaming DiLoCo paper.

    Block j of the model's largest ``nn.ModuleList`` goes to fragment j mod P (blocks are
    interleaved across fragments). Every other trainable parameter (embeddings, final norm,
    head) goes, in ``named_parameters()`` order, to the fragment with the fewest elements so
    far (ties: the lowest index), which keeps the fragments' sizes — and so the bursts on the
    link — close to each other. Deterministic: every rank computes the same split.
    """
    blocks = _find_blocks(model)
    if blocks is None or len(blocks) < num_fragments:
        found = 0 if blocks is None else len(blocks)
        raise ValueError(
            f"automatic fragments need at least num_fragments={num_fragments} transformer "
            f"blocks in an nn.ModuleList, found {found}; pass fragments=[module, ...] instead"
        )
    groups: list[list[torch.Tensor]] = [[] for _ in range(num_fragments)]
    in_blocks: set[int] = set()
    for j, block in enumerate(blocks):
        for p in block.parameters():
            if p.requires_grad and id(p) not in in_blocks:
                groups[j % num_fragments].append(p)
                in_blocks.add(id(p))
    sizes = [sum(p.numel() for p in g) for g in groups]
    seen: set[int] = set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in in_blocks or id(p) in seen:
            continue
        seen.add(id(p))
        i = min(range(num_fragments), key=lambda f: (sizes[f], f))
        groups[i].append(p)
        sizes[i] += p.numel()
    return groups


def check_partition(
    groups: list[list[torch.Tensor]], params: Sequence[torch.Tensor]
) -> list[list[torch.Tensor]]:
    """``groups`` if they hold every one of ``params`` exactly once (and nothing else)."""
    mine = {id(q) for q in params}
    seen: set[int] = set()
    for i, g in enumerate(groups):
        if not g:
            raise ValueError(f"fragment {i} has no trainable parameters")
        for q in g:
            if id(q) in seen:
                raise ValueError(f"a parameter appears in two fragments (again in {i})")
            if id(q) not in mine:
                raise ValueError(f"fragment {i} holds a parameter that is not in the model")
            seen.add(id(q))
    if len(seen) != len(mine):
        raise ValueError(
            f"{len(mine) - len(seen)} trainable parameter(s) are in no fragment and would "
            "never be synchronised; give every parameter to a fragment"
        )
    return groups
