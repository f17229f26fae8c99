"""Zeroth-order fine-tuning (``lowcomm finetune``): bytes, memory, throughput and learning, side
by side in one run on this machine.

* **memory**: the peak resident memory a step adds to a process that holds a 25 M-parameter GPT
  (n_embd 512, 8 layers; fp32), for an inference forward, a MeZO step (plain and blockwise) and
  an AdamW step, each in a fresh process (``ru_maxrss`` after three steps less the resident
  memory once the model is built);
* **throughput**: ``lowcomm finetune`` of the default pretrained model, one thread per worker
  (every worker gets the same compute, the analogue of adding GPUs): MeZO on 1 worker, PertP on
  2, DDP on 2, and blockwise; beside them the time of one forward (F) and of one pass drawing z
  over the parameters (Z) measured in this process, and the speed-up the model
  (2F + 4Z) / (per-worker time) predicts: a PertP worker does F + 4Z, a DDP worker 2F/W + 4Z —
  z is regenerated on every worker whatever their number, so adding workers never halves it;
* **learning**: the held-out loss of 300 fine-tuning steps on ``stdlib-code`` from the default
  ``lowcomm train`` checkpoint (CO2, 960 steps) for MeZO single, PertP, DDP on 2, 2D on 4, and
  AdamW with DDP on 2, with the bytes each sends per worker per step.

Reproduce (about 10 minutes on 2 cores)::

    python benchmarks/zo_finetune.py

It prints markdown and writes ``benchmarks/zo_finetune.md`` and ``docs/zo-finetune.png``;
run folders go to ``benchmarks/results/zo/`` (not committed).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "zo"
PRETRAINED = OUT / "pretrained"
STEPS = 300
BIG = {"n_embd": 512, "n_layer": 8, "n_head": 8, "block_size": 256}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def memory_probe(kind: str) -> dict[str, float]:
    """One process's figures for ``kind`` (run in a fresh interpreter by :func:`memory`)."""
    from lowcomm.models.gpt import GPT, GPTConfig
    from lowcomm.zo import MeZO

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, dropout=0.0, **BIG))
    x = torch.randint(0, 256, (4, BIG["block_size"]))
    y = torch.randint(0, 256, (4, BIG["block_size"]))
    base = _rss()
    zo = None
    if kind.startswith("zo"):
        zo = MeZO(model, lr=1e-6, blockwise=kind == "zo-blockwise")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if kind == "adamw" else None
    for _ in range(3):
        if kind == "inference":
            with torch.inference_mode():
                model(x, y)
        elif zo is not None and zo.blockwise:
            zo.step(stages=model.zo_stages(x, y))
        elif zo is not None:
            zo.step(lambda: model(x, y)[1])
        else:
            assert optimizer is not None
            model(x, y)[1].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    largest = max(p.numel() for p in model.parameters()) * 4
    params = sum(p.numel() for p in model.parameters())
    return {
        "extra_mb": (peak - base) / 2**20,
        "params_mb": params * 4 / 2**20,
        "params": params,
        "largest_tensor_mb": largest / 2**20,
    }


def memory() -> list[tuple[str, dict[str, float]]]:
    rows = []
    for kind in ("inference", "zo", "zo-blockwise", "adamw"):
        done = subprocess.run(
            [sys.executable, __file__, "--probe", kind], check=True, capture_output=True, text=True
        )
        rows.append((kind, json.loads(done.stdout.strip().splitlines()[-1])))
    return rows


def finetune(name: str, *flags: str, steps: int = STEPS) -> dict:
    out = OUT / name
    cmd = [sys.executable, "-m", "lowcomm", "finetune", "--init", str(PRETRAINED)]
    cmd += ["--steps", str(steps), "--eval-every", str(max(1, steps // 6)), "--quiet"]
    cmd += ["--overwrite", "--out", str(out), *flags]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((out / "summary.json").read_text())
    summary["curve"] = [
        (r["step"], r["val_loss"])
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "eval"
    ]
    return summary


def forward_and_z() -> tuple[float, float]:
    """Seconds of one forward on the global batch and of one z pass, one thread."""
    from lowcomm.zo.finetune import FinetuneConfig, load_model

    torch.set_num_threads(1)
    model, _ = load_model(FinetuneConfig(init=str(PRETRAINED)))
    model.eval()
    x = torch.randint(0, 256, (16, 64))
    gen = torch.Generator()
    params = [p for p in model.parameters()]
    with torch.inference_mode():
        model(x, x)
        t = time.perf_counter()
        for _ in range(20):
            model(x, x)
        forward = (time.perf_counter() - t) / 20
        t = time.perf_counter()
        for _ in range(20):
            gen.manual_seed(1)
            for p in params:
                z = torch.normal(0, 1, size=p.size(), generator=gen)
                z.mul_(1).mul_(1e-3)
                p.add_(z)
        z_pass = (time.perf_counter() - t) / 20
    return forward, z_pass


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    if not (PRETRAINED / "checkpoint.pt").is_file():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "lowcomm",
                "train",
                "--quiet",
                "--overwrite",
                "--out",
                str(PRETRAINED),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    lines = [
        "# Zeroth-order fine-tuning: measured",
        "",
        "Produced by `python benchmarks/zo_finetune.py` (2-core CPU machine).",
        "",
    ]

    lines += ["## Memory (25 M-parameter GPT, batch 4 x 256, fp32, one thread)", ""]
    lines += ["| step | peak memory added to the process |", "|---|---|"]
    mem = memory()
    for kind, row in mem:
        lines.append(f"| {kind} | {row['extra_mb']:.0f} MiB |")
    info = mem[0][1]
    lines += [
        "",
        f"Parameters: {info['params']:,} ({info['params_mb']:.0f} MiB); largest tensor "
        f"{info['largest_tensor_mb']:.1f} MiB.",
        "",
    ]

    lines += ["## Throughput (one thread per worker; 60 steps of 16 x 64 bytes)", ""]
    forward, z_pass = forward_and_z()
    single_time = 2 * forward + 4 * z_pass
    runs = [
        ("single", 1, ["--method", "zo", "--threads", "1"], single_time / single_time),
        (
            "single, blockwise",
            1,
            ["--method", "zo", "--threads", "1", "--blockwise"],
            single_time / (2 * forward + 2 * z_pass),
        ),
        (
            "pertp",
            2,
            ["--method", "zo", "--mode", "pertp", "--workers", "2", "--threads", "1"],
            single_time / (forward + 4 * z_pass),
        ),
        (
            "pertp, blockwise",
            2,
            [
                "--method",
                "zo",
                "--mode",
                "pertp",
                "--workers",
                "2",
                "--threads",
                "1",
                "--blockwise",
            ],
            single_time / (forward + 2 * z_pass),
        ),
        (
            "ddp",
            2,
            ["--method", "zo", "--mode", "ddp", "--workers", "2", "--threads", "1"],
            single_time / (forward + 4 * z_pass),
        ),
    ]
    results = {
        name: finetune(f"speed-{name.replace(', ', '-')}", *flags, steps=60)
        for name, _, flags, _ in runs
    }
    base = results["single"]["tokens_per_s"]
    lines += [
        f"F (one forward, 16 x 64) = {forward * 1e3:.1f} ms; "
        f"Z (one z pass) = {z_pass * 1e3:.1f} ms.",
        "",
    ]
    lines += [
        "| run | workers | tokens/s | speed-up, measured | predicted | bytes / worker / step |",
        "|---|---|---|---|---|---|",
    ]
    for name, workers, _, predicted in runs:
        r = results[name]
        lines.append(
            f"| {name} | {workers} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}x | "
            f"{predicted:.2f}x | {r['bytes_sent_per_worker_per_step']:.0f} |"
        )
    lines.append("")

    lines += [
        f"## Learning ({STEPS} steps of 16 x 64 bytes on stdlib-code, "
        "from the default lowcomm train checkpoint)",
        "",
    ]
    learn = [
        ("MeZO single", ["--method", "zo"]),
        ("MeZO PertP, 2", ["--method", "zo", "--mode", "pertp", "--workers", "2"]),
        ("MeZO DDP, 2", ["--method", "zo", "--mode", "ddp", "--workers", "2"]),
        ("MeZO 2D, 4", ["--method", "zo", "--mode", "2d", "--workers", "4"]),
        ("AdamW DDP, 2", ["--method", "adamw", "--mode", "ddp", "--workers", "2"]),
    ]
    curves = {}
    lines += [
        "| run | held-out loss: zero-shot -> final | bytes / worker / step |",
        "|---|---|---|",
    ]
    for name, flags in learn:
        slug = name.lower().replace(",", "").replace(" ", "-")
        r = finetune(f"learn-{slug}", *flags)
        curves[name] = r["curve"]
        lines.append(
            f"| {name} | {r['val_loss_initial']:.4f} -> {r['val_loss_final']:.4f} | "
            f"{r['bytes_sent_per_worker_per_step']:,.0f} |"
        )
    _plot(curves, HERE.parent / "docs" / "zo-finetune.png")
    lines += ["", "![held-out loss](../docs/zo-finetune.png)", ""]
    text = "\n".join(lines)
    (HERE / "zo_finetune.md").write_text(text)
    print(text)


def _plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4), dpi=110)
    styles = ["-", "--", ":", "-.", "-"]
    for (name, curve), style in zip(curves.items(), styles):
        ax.plot(
            [s for s, _ in curve],
            [v for _, v in curve],
            style,
            marker="o",
            markersize=3,
            label=name,
        )
    ax.set_xlabel("fine-tuning step")
    ax.set_ylabel("held-out loss (nats / byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        print(json.dumps(memory_probe(sys.argv[2])))
    else:
        main()
