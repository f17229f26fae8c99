"""``lowcomm bench --balance``: length-aware balancing measured on real multi-process jobs.

Every job is ``lowcomm train --documents`` on the same long-tailed corpus (the standard
library's source unless ``--data``, or ``--corpus lognormal``: 2,000 generated documents of
log-normal length, :func:`~lowcomm.balance.documents.lognormal_texts`), the same seed and the
same tokens per step; only the assignment of documents to ranks differs. Each job's
``balance.json`` gives per plan unit (a step for DDP, a round for CO2) every rank's compute
time, the straggler wait
``max_j t_j - t_r``, the idle fraction and the cost model's prediction; its ``summary.json``
the tokens per second. Two sections:

- **assignment**: random, sequential, group-by-length, token-balanced, cost-balanced,
  cost-balanced + splitting and remapping (DDP only: it balances steps), with DDP (balanced per
  step) and with CO2 (per round);
- **splitting**: a corpus where one document can dominate a step (the standard library's long
  source files among many 256-byte pieces of the others; ``--split-block-size`` tokens, one
  sequence per worker per step): on one node random (no balancing), cost-balanced, with
  splitting and remapping; splitting
  on 2 nodes x 2 joined by a slow emulated link (split inside a node only), and on 4 nodes x 1
  (every split would cross the slow link: refused).

With more workers than CPU cores the jobs wait for collectives by polling (``--busy-wait``), so
that a waiting worker keeps its share of the cores: as if every worker had a device of its own.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ASSIGNMENTS", "BalanceSpec", "format_balance", "run_balance", "run_cost_model"]

logger = logging.getLogger(__name__)

ASSIGNMENTS: dict[str, str] = {
    "random": "random",
    "sequential": "sequential",
    "group-by-length": "length",
    "token-balanced": "tokens",
    "cost-balanced": "cost",
    "cost-balanced + split": "cost+split",
    "remap": "remap",
}
"""The assignment section's rows: name -> ``lowcomm train --balance`` entry."""
NAMES = {entry: name for name, entry in ASSIGNMENTS.items()}


@dataclass
class BalanceSpec:
    """What ``lowcomm bench --balance`` runs (see the module docstring)."""

    workers: int = 4
    algos: list[str] = field(default_factory=lambda: ["ddp", "co2"])
    assignments: list[str] = field(default_factory=lambda: list(ASSIGNMENTS))
    cycles: int = 16
    """Plan units per assignment with DDP (the first is left out as start-up)."""
    round_cycles: int = 6
    """Rounds per assignment with an outer algorithm."""
    split_cycles: int = 10
    """Steps per assignment in the splitting section."""
    sync_every: int = 4
    block_size: int = 4096
    """The longest document piece (the model's context) of the assignment section."""
    batch_size: int = 4
    """Tokens per worker per step = batch_size x block_size."""
    split_block_size: int = 8192
    split_batch_size: int = 1
    split_link: str = "100mbit"
    long_every: int = 128
    """The splitting section's corpus (without ``--data``): one long document per this many
    short ones, so that about one step in a few holds a document that dominates it."""
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    seed: int = 0
    data: str | None = None
    corpus: str = "stdlib"
    """The assignment section's documents without ``data``: ``stdlib`` (the standard library's
    source) or ``lognormal`` (:func:`~lowcomm.balance.documents.lognormal_texts`, written to
    ``out``)."""
    busy_wait: bool | None = None
    """Poll collectives (default: when there are more workers than CPU cores)."""
    splitting: bool = True
    """Run the splitting section."""
    out: str = "runs/balance"

    def __post_init__(self) -> None:
        unknown = [a for a in self.assignments if a not in ASSIGNMENTS]
        if unknown:
            raise ValueError(
                f"unknown assignment {unknown[0]!r}: choose from {', '.join(ASSIGNMENTS)}"
            )
        if self.workers < 2:
            raise ValueError(f"--workers {self.workers}: balancing needs at least 2 workers")
        if self.corpus not in ("stdlib", "lognormal"):
            raise ValueError(f"--corpus {self.corpus!r}: choose stdlib or lognormal")
        if self.corpus != "stdlib" and self.data is not None:
            raise ValueError("--corpus and --data both choose the documents: give one")
        if self.splitting and self.workers % 2:
            raise ValueError(
                f"--workers {self.workers}: the splitting section runs 2 nodes; use an even "
                "count or --no-splitting"
            )

    @property
    def polls(self) -> bool:
        if self.busy_wait is not None:
            return self.busy_wait
        return self.workers > (os.cpu_count() or 1)

    @property
    def assignment_data(self) -> str | None:
        """The assignment section's ``--data``."""
        if self.corpus == "lognormal":
            return os.path.join(self.out, LOGNORMAL_CORPUS)
        return self.data

    def jobs(self) -> list[dict[str, Any]]:
        """Every job: its section, name and ``TrainConfig`` values."""
        base = {
            "documents": True,
            "workers": self.workers,
            "sync_every": self.sync_every,
            "seed": self.seed,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_embd": self.n_embd,
            "warmup": 2,
            "eval_every": 10**6,
            "eval_batches": 2,
            "busy_wait": self.polls,
            "balance_paired": True,
            "data": self.assignment_data,
            "overwrite": True,
            "quiet": True,
        }
        entries = [ASSIGNMENTS[name] for name in self.assignments]
        jobs = []
        for algo in self.algos:
            per_unit = 1 if algo in ("ddp", "none") else self.sync_every
            cycles = self.cycles if per_unit == 1 else self.round_cycles
            # remapping balances steps: an outer algorithm, which plans rounds, goes without it
            mine = [e for e in entries if per_unit == 1 or e != "remap"]
            values = {
                **base,
                "algo": algo,
                "balance": ",".join(mine),
                "steps": cycles * len(mine) * per_unit,
                "block_size": self.block_size,
                "batch_size": self.batch_size,
            }
            jobs.append({"section": "assignment", "algo": algo, "layout": "1 node", "cfg": values})
        if self.splitting:
            split = {
                **base,
                "data": self.data or os.path.join(self.out, DOMINANT_CORPUS),
                "algo": "ddp",
                "balance": "cost,cost+split",
                "steps": 2 * self.split_cycles,
                "block_size": self.split_block_size,
                "batch_size": self.split_batch_size,
            }
            w = self.workers
            for nodes, link in ((1, None), (2, self.split_link), (w, self.split_link)):
                values = {**split, "link": link}
                if nodes == 1:
                    # on one node, also against no balancing and against remapping
                    values.update(
                        balance="random,cost,cost+split,remap", steps=4 * self.split_cycles
                    )
                layout = "1 node"
                if nodes > 1:
                    values.pop("workers")
                    values.update(nodes=nodes, procs_per_node=w // nodes)
                    layout = f"{nodes} nodes x {w // nodes}, {link} between"
                jobs.append(
                    {"section": "splitting", "algo": "ddp", "layout": layout, "cfg": values}
                )
        return jobs


DOMINANT_CORPUS = "dominant.jsonl"
"""The splitting section's corpus, written to ``--out``."""
LOGNORMAL_CORPUS = "lognormal.jsonl"
"""The assignment section's generated corpus (``--corpus lognormal``), written to ``--out``."""


def write_lognormal_corpus(path: str, *, seed: int = 0) -> dict[str, int]:
    """:func:`~lowcomm.balance.documents.lognormal_texts` as JSON lines; returns the count, the
    median and the largest length."""
    from lowcomm.balance.documents import lognormal_texts

    texts = lognormal_texts(seed=seed)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    lengths = sorted(len(t) for t in texts)
    return {"documents": len(texts), "median": lengths[len(lengths) // 2], "max": lengths[-1]}


def write_dominant_corpus(path: str, *, long_tokens: int, long_every: int) -> dict[str, int]:
    """A corpus where one document can dominate a step, from the standard library's source:
    source files of at least ``long_tokens`` bytes whole (the long documents), and
    ``long_every`` short documents per long one: 256-byte pieces of every file, in order.
    Written as JSON lines; returns the counts."""
    from lowcomm.balance.documents import stdlib_texts

    texts = stdlib_texts()
    pieces: list[str] = []
    for t in texts:
        raw = t.encode()
        pieces += [raw[i : i + 256].decode("utf-8", "ignore") for i in range(0, len(raw), 256)]
    pieces = [p for p in pieces if len(p) > 64]
    long = [t for t in texts if len(t.encode()) >= long_tokens + 1][: len(pieces) // long_every]
    short = pieces[: long_every * len(long)]
    docs = []
    for i, text in enumerate(long):
        docs.append(text)
        docs += short[i * long_every : (i + 1) * long_every]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for text in docs:
            f.write(json.dumps({"text": text}) + "\n")
    return {"long": len(long), "short": len(short)}


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-").replace("--", "-")


def _rows(job: dict[str, Any], folder: str) -> list[dict[str, Any]]:
    with open(os.path.join(folder, "balance.json"), encoding="utf-8") as f:
        balance = json.load(f)
    rows = []
    paired = _split_pairs(balance)
    for entry, s in balance["assignments"].items():
        rows.append(
            {
                "section": job["section"],
                "algo": job["algo"],
                "layout": job["layout"],
                "assignment": NAMES.get(entry, entry),
                "unit_steps": balance["unit_steps"],
                **{k: s[k] for k in _KEYS},
                "cost_model_fit_error": balance["cost_model"].get("rms_rel_error"),
                "split_pairs": paired if entry == "cost+split" else None,
                "folder": folder,
            }
        )
    return rows


def _split_pairs(balance: dict[str, Any]) -> dict[str, Any] | None:
    """The units where cost+split split a document, against the cost unit of the same turn
    (the same documents with paired assignments): mean slowest-rank compute and wall time."""
    units = [u for u in balance["units"] if u["unit"] > 0]
    names = list(dict.fromkeys(u["assignment"] for u in balance["units"]))
    if "cost" not in names or "cost+split" not in names:
        return None
    by_turn = {(u["unit"] // len(names), u["assignment"]): u for u in units}
    pairs = [
        (by_turn[(turn, "cost")], u)
        for (turn, name), u in by_turn.items()
        if name == "cost+split"
        and any(k > 1 for k, _, _ in u["splits"])
        and (turn, "cost") in by_turn
    ]
    if not pairs:
        return None
    return {
        "units": len(pairs),
        "slowest_without_s": statistics.fmean(max(a["compute_s"]) for a, _ in pairs),
        "slowest_with_s": statistics.fmean(max(b["compute_s"]) for _, b in pairs),
        "wall_without_s": statistics.fmean(a["wall_s"] for a, _ in pairs),
        "wall_with_s": statistics.fmean(b["wall_s"] for _, b in pairs),
        "planned_without": statistics.fmean(max(a["predicted_s"]) for a, _ in pairs),
        "planned_with": statistics.fmean(max(b["predicted_s"]) for _, b in pairs),
    }


_KEYS = (
    "units",
    "idle_fraction",
    "straggler_wait_s",
    "max_compute_s",
    "mean_compute_s",
    "wall_s",
    "tokens_per_s",
    "cost_model_error",
    "cost_model_error_tracked",
    "plan_ratio",
    "documents_split",
    "refused_by_link",
    "split_tiers",
)


def run_balance(
    spec: BalanceSpec, *, command: str, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run every job of ``spec`` (one after another) and write ``results.json`` and
    ``balance.md`` to ``spec.out``; returns the results."""
    from lowcomm.train.config import config_from_dict
    from lowcomm.train.launcher import launch

    os.makedirs(spec.out, exist_ok=True)
    if spec.corpus == "lognormal":
        write_lognormal_corpus(os.path.join(spec.out, LOGNORMAL_CORPUS), seed=spec.seed)
    if spec.splitting and spec.data is None:
        write_dominant_corpus(
            os.path.join(spec.out, DOMINANT_CORPUS),
            long_tokens=spec.split_block_size,
            long_every=spec.long_every,
        )
    rows = []
    jobs = spec.jobs()
    for i, job in enumerate(jobs, 1):
        name = _slug(f"{job['section']}-{job['algo']}-{job['layout']}")
        folder = os.path.join(spec.out, "jobs", name)
        cfg = config_from_dict(
            {**job["cfg"], "out": folder, "name": name}, source="bench --balance"
        ).with_paths()
        if progress is not None:
            progress(
                f"[{i}/{len(jobs)}] {job['section']}: {job['algo']}, {job['layout']}, "
                f"{cfg.steps} steps of {cfg.balance}"
            )
        t0 = time.perf_counter()
        launch(cfg)
        for row in _rows(job, folder):
            row["command_s"] = time.perf_counter() - t0
            rows.append(row)
    errors = [r["cost_model_error"] for r in rows if r["cost_model_error"] is not None]
    tracked = [r["cost_model_error_tracked"] for r in rows if r["cost_model_error_tracked"]]
    results = {
        "command": command,
        "spec": asdict(spec),
        "busy_wait": spec.polls,
        "cpu_count": os.cpu_count(),
        "rows": rows,
        "cost_model_error_mean": statistics.fmean(errors) if errors else None,
        "cost_model_error_tracked_mean": statistics.fmean(tracked) if tracked else None,
    }
    with open(os.path.join(spec.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(spec.out, "balance.md"), "w", encoding="utf-8") as f:
        f.write(format_balance(results))
    return results


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def format_balance(results: dict[str, Any]) -> str:
    """The results as Markdown tables."""
    spec = results["spec"]
    lines = [
        f"Command: `{results['command']}`",
        "",
        f"{spec['workers']} workers on {results['cpu_count']} CPU cores"
        + (", waiting by polling (one device per worker, emulated)" if results["busy_wait"] else "")
        + f"; GPT {spec['n_layer']} layers x {spec['n_embd']} wide; "
        "the assignments of a section taken in turn per step (DDP) or round (CO2) in one job, "
        "each turn's assignments on the same documents (`--balance-paired`), so that they share "
        "the machine's state and the work; each one's first unit left out as start-up.",
        "",
        "Idle fraction: sum over ranks of (slowest rank's compute - this rank's) / (ranks x "
        "slowest), per step (DDP) or round (CO2). Straggler wait: its mean per rank. Cost model "
        "error: mean |predicted - measured| / measured per rank and unit; tracked: with the "
        "prediction scaled by the previous unit's measured / predicted time.",
        "",
    ]
    head = (
        "| algo | layout | assignment | idle | straggler wait (s) | slowest rank (s) "
        "| unit time (s) | tokens/s | cost model error (tracked) | split |"
    )
    sep = "|---|---|---|---:|---:|---:|---:|---:|---:|---|"
    for section, title in (
        (
            "assignment",
            f"Assignment ({spec['block_size']}-token cap, {spec['batch_size']} x "
            f"{spec['block_size']} tokens per worker per step)",
        ),
        (
            "splitting",
            "Splitting (a corpus where one document can dominate a step: the standard "
            f"library's source files of {spec['split_block_size']}+ bytes among "
            f"{spec['long_every']} times as many 256-byte pieces; "
            f"{spec['split_block_size']}-token cap, "
            f"{spec['split_batch_size']} x {spec['split_block_size']} tokens per worker per step, "
            "DDP)",
        ),
    ):
        rows = [r for r in results["rows"] if r["section"] == section]
        if not rows:
            continue
        lines += [f"### {title}", "", head, sep]
        for r in rows:
            split = "-"
            if r["documents_split"] or r["refused_by_link"]:
                split = f"{r['documents_split']} split"
                if r["split_tiers"]:
                    split += f" ({', '.join(r['split_tiers'])})"
                if r["refused_by_link"]:
                    split += f", {r['refused_by_link']} refused by the link"
            lines.append(
                f"| {r['algo']} | {r['layout']} | {r['assignment']} | "
                f"{_pct(r['idle_fraction'])} | {_num(r['straggler_wait_s'], '.3f')} | "
                f"{_num(r['max_compute_s'])} | {_num(r['wall_s'])} | "
                f"{_num(r['tokens_per_s'], ',.0f')} | "
                f"{_pct(r['cost_model_error'])} ({_pct(r['cost_model_error_tracked'])}) | "
                f"{split} |"
            )
        lines.append("")
        for r in rows:
            sp = r.get("split_pairs")
            if sp:
                lines.append(
                    f"- {r['layout']}: on the {sp['units']} steps where a document was split, "
                    f"the slowest rank took {sp['slowest_with_s']:.2f} s against "
                    f"{sp['slowest_without_s']:.2f} s for the same documents unsplit "
                    f"(predicted {sp['planned_with']:.2f} s against "
                    f"{sp['planned_without']:.2f} s); the step {sp['wall_with_s']:.2f} s "
                    f"against {sp['wall_without_s']:.2f} s."
                )
        if any(r.get("split_pairs") for r in rows):
            lines.append("")
    lines.append(
        f"Cost model error over every row: {_pct(results['cost_model_error_mean'])} with the "
        "start-up fit; "
        f"{_pct(results['cost_model_error_tracked_mean'])} with the device's speed tracked "
        "(the prediction scaled by the previous unit's measured / predicted time)."
    )
    return "\n".join(lines) + "\n"


def run_cost_model(
    *, block_size: int, n_layer: int, n_head: int, n_embd: int, repeats: int = 3
) -> dict[str, Any]:
    """Fit the cost model of a GPT of this shape on this device (one process, one thread: a
    worker's share of a CPU) and check it on micro-batches packed from the embedded documents
    that the fit did not see."""
    import torch

    from lowcomm.balance import load_documents, measure_cost_model
    from lowcomm.models.gpt import GPT, GPTConfig, Packed

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as one worker of lowcomm train per core
    model = GPT(
        GPTConfig(
            vocab_size=256, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd
        )
    )
    fit = measure_cost_model(model, block_size, repeats=repeats)
    corpus = load_documents()
    gen = torch.Generator().manual_seed(1)
    checks: list[dict[str, Any]] = []
    errors: list[float] = []
    for _ in range(8):
        lengths, room = [], block_size
        while room > 16:
            i = int(torch.randint(len(corpus.train), (1,), generator=gen))
            n = min(len(corpus.train[i]) - 1, room)
            lengths.append(n)
            room -= n
        x = torch.randint(256, (1, sum(lengths)), generator=gen)
        times = []
        for k in range(repeats + 1):
            t0 = time.perf_counter()
            _, loss = model(x, x, packed=Packed(lengths=lengths), reduction="sum")
            assert loss is not None
            loss.backward()
            if k:
                times.append(time.perf_counter() - t0)
        measured = statistics.median(times)
        predicted = fit.model.batch(lengths)
        errors.append(abs(predicted - measured) / measured)
        checks.append(
            {
                "lengths": lengths,
                "measured_s": measured,
                "predicted_s": predicted,
                "error": errors[-1],
            }
        )
    torch.set_num_threads(threads)
    return {
        "fit": fit.as_dict(),
        "held_out": checks,
        "held_out_error_mean": statistics.fmean(errors),
        "crossover_tokens": fit.model.crossover(),
    }
