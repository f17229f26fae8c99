"""Muon on a model's hidden weight matrices and AdamW on the rest, as one inner optimizer.

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) orthogonalises each weight
matrix's momentum by a Newton–Schulz iteration; it is meant for the 2-D weights of the hidden
linear layers, while embeddings, the output head, biases and norm gains stay on AdamW. With
``adjust_lr_fn="match_rms_adamw"`` (Liu et al. 2025, "Muon is Scalable for LLM Training",
https://arxiv.org/abs/2502.16982) its update has AdamW's RMS, so both take the same learning rate
and weight decay, and one schedule drives both. torch ships Muon as :class:`torch.optim.Muon`
(2-D parameters only); :class:`MuonAdamW` pairs it with :class:`torch.optim.AdamW` behind one
``step()``, one ``state_dict()`` and one list of ``param_groups`` (the same group dicts as the two
optimizers', so setting ``group["lr"]`` sets theirs), which is what lowcomm's outer algorithms
and the ``lowcomm train`` loop take as "the inner optimizer". A step is exactly Muon's step on
its parameters followed by AdamW's on the others (a test pins it).

Example::

    inner = MuonAdamW.for_model(model, lr=2e-3, weight_decay=0.1)
    algo = lowcomm.StreamingDiLoCo(model, inner, sync_every=12, num_fragments=4, overlap=12)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["MuonAdamW", "muon_parameters"]


def muon_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The parameters Muon takes: the weights of the model's ``nn.Linear`` layers (2-D), less any
    tied to an ``nn.Embedding`` (a tied output head stays with the embedding, on AdamW)."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    seen: set[int] = set()
    out = []
    for m in model.modules():
        if isinstance(m, nn.Linear) and m.weight.requires_grad:
            w = m.weight
            if id(w) not in embedded and id(w) not in seen:
                seen.add(id(w))
                out.append(w)
    return out


class MuonAdamW(torch.optim.Optimizer):
    """:class:`torch.optim.Muon` over ``muon_groups`` and :class:`torch.optim.AdamW` over
    ``adamw_groups`` as one optimizer (see the module docstring). Every group takes ``lr``; Muon
    scales it to AdamW's update RMS (``adjust_lr_fn="match_rms_adamw"``). ``weight_decay`` is
    each group's own (``{"params": [...], "weight_decay": 0.0}``), else the argument."""

    def __init__(
        self,
        muon_groups: Iterable[dict[str, Any]],
        adamw_groups: Iterable[dict[str, Any]],
        *,
        lr: float,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        momentum: float = 0.95,
    ) -> None:
        muon_groups = [dict(g) for g in muon_groups if list(g["params"])]
        adamw_groups = [dict(g) for g in adamw_groups if list(g["params"])]
        for g in muon_groups:
            for p in g["params"]:
                if p.dim() != 2:
                    raise ValueError(
                        f"Muon takes 2-D weight matrices, got a parameter of shape "
                        f"{tuple(p.shape)}; put it in adamw_groups (muon_parameters(model) "
                        "picks the nn.Linear weights)"
                    )
        if not muon_groups:
            raise ValueError(
                "MuonAdamW got no parameters for Muon (the model has no nn.Linear weights "
                "outside its embeddings); use AdamW"
            )
        self._muon = torch.optim.Muon(
            muon_groups,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            adjust_lr_fn="match_rms_adamw",
        )
        self._adamw = (
            torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, weight_decay=weight_decay)
            if adamw_groups
            else None
        )
        # the same group dicts: the job's schedule sets group["lr"] on this optimizer's groups
        super().__init__(self._groups(), {"lr": lr})

    @classmethod
    def for_model(cls, model: nn.Module, *, lr: float, weight_decay: float = 0.1) -> MuonAdamW:
        """Muon on :func:`muon_parameters`, AdamW on the rest: weight decay on the other 2-D
        parameters (embeddings), none on biases and norm gains."""
        muon = muon_parameters(model)
        taken = {id(p) for p in muon}
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
        return cls(
            [{"params": muon, "weight_decay": weight_decay}],
            [
                {"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
                {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=lr,
            weight_decay=weight_decay,
        )

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [self._muon] + ([self._adamw] if self._adamw is not None else [])

    def _groups(self) -> list[dict[str, Any]]:
        return [g for opt in self._optimizers() for g in opt.param_groups]

    @property  # type: ignore[override]
    def state(self) -> dict[torch.Tensor, Any]:
        """Both optimizers' per-parameter state (read-only view)."""
        merged: dict[torch.Tensor, Any] = {}
        for opt in self._optimizers():
            merged.update(opt.state)
        return merged

    @state.setter
    def state(self, value: Any) -> None:
        pass  # the two optimizers hold the state; torch's constructor assigns an empty one

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self._optimizers():
            opt.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self._muon.state_dict(), "adamw": self._adamw_state()}

    def _adamw_state(self) -> dict[str, Any] | None:
        return None if self._adamw is None else self._adamw.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError(
                "not a MuonAdamW state_dict (expected keys 'muon' and 'adamw'); a checkpoint "
                "of another inner optimizer resumes with that optimizer"
            )
        self._muon.load_state_dict(state_dict["muon"])
        if (state_dict["adamw"] is None) != (self._adamw is None):
            raise ValueError("MuonAdamW state_dict has a different split of Muon/AdamW params")
        if self._adamw is not None:
            self._adamw.load_state_dict(state_dict["adamw"])
        # torch's load_state_dict builds new group dicts: point at them again
        self.param_groups = self._groups()
