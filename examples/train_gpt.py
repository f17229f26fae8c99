"""Train a small GPT with CO2 in a plain PyTorch loop: the whole recipe on one page.

CO2 (Sun et al., ICLR 2024, https://arxiv.org/abs/2401.16265) lets every worker train on its own
for ``sync_every`` (H) steps, then averages the workers' progress with an all-reduce that runs in
the background during the next H steps. The loop below is ordinary PyTorch plus two lines:
``algo.step()`` after each optimizer step and ``algo.finish()`` at the end.

Run it (CPU, this machine, 2 workers; gloo):

    torchrun --nnodes 1 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
        examples/train_gpt.py

torchrun's agent hosts its rendezvous store on every network interface of the machine, whatever
address ``--rdzv-endpoint`` names (``--standalone`` too; checked with ``ss -ltn`` on torch 2.13):
on a machine that others can reach, keep its ports behind a firewall, or run ``lowcomm train``,
whose launcher listens on 127.0.0.1 only.

One process, no torchrun (world size 1; CO2 then has no one to talk to, but it runs):

    python examples/train_gpt.py --steps 120

One GPU node with 8 GPUs (NCCL):

    torchrun --nnodes 1 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
        examples/train_gpt.py --device cuda

Two nodes of 8 GPUs each; run this on both, HOST being the first node's address:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        examples/train_gpt.py --device cuda

The ``lowcomm train`` command does the same with metrics, checkpoints and a summary.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import lowcomm
from lowcomm.data import eval_batches, get_batch, load_corpus, make_generator
from lowcomm.models.gpt import GPT, GPTConfig

# -- settings ---------------------------------------------------------------------------------
parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--steps", type=int, default=480, help="inner steps per worker")
parser.add_argument("--sync-every", type=int, default=12, help="H: inner steps per round")
# CO2's default alpha = 1.0 (with outer momentum beta = 0.5) overshoots on a model this small;
# 0.5 trains smoothly.
parser.add_argument("--outer-lr", type=float, default=0.5, help="alpha: CO2 outer learning rate")
parser.add_argument("--lr", type=float, default=2e-3, help="inner AdamW learning rate")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--block-size", type=int, default=64)
parser.add_argument("--data", default=None, help="text file or folder; default: embedded corpus")
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

# -- distributed set-up -----------------------------------------------------------------------
# torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, ...; without it we are a world of one.
if "RANK" not in os.environ:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
local_rank = int(os.environ["LOCAL_RANK"])
if args.device == "cuda":
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    backend = "nccl"
else:
    device = torch.device("cpu")
    backend = "gloo"
    # Workers on one machine share its cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
master = rank == 0

# -- data and model ---------------------------------------------------------------------------
corpus = load_corpus(args.data)  # byte-level tokens, train/val split
gen = make_generator(args.seed, rank)  # each worker draws different batches
val = eval_batches(corpus.val, args.batch_size, args.block_size, num_batches=8)

torch.manual_seed(args.seed)  # the same initial model on every worker
config = GPTConfig(
    vocab_size=corpus.vocab_size, block_size=args.block_size, n_layer=4, n_head=4, n_embd=128
)
model = GPT(config).to(device)
inner = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
algo = lowcomm.CO2(model, inner, sync_every=args.sync_every, outer_lr=args.outer_lr)


@torch.no_grad()
def val_loss() -> float:
    model.eval()
    losses = [model(x.to(device), y.to(device))[1].item() for x, y in val]
    model.train()
    return sum(losses) / len(losses)


if master:
    print(f"{world} worker(s) on {device}, {model.num_parameters() / 1e6:.2f} M parameters")
    print(f"step {0:5d} | val loss {val_loss():.3f}")

# -- training loop ----------------------------------------------------------------------------
t0 = time.perf_counter()
for step in range(1, args.steps + 1):
    x, y = get_batch(corpus.train, args.batch_size, args.block_size, gen)
    _, loss = model(x.to(device), y.to(device))
    loss.backward()
    inner.step()
    inner.zero_grad(set_to_none=True)
    algo.step()  # every H steps: launch this round's all-reduce, apply the previous round's

    # Right after a round boundary every worker holds the same (consensus) model.
    if master and step % (10 * args.sync_every) == 0:
        print(f"step {step:5d} | train loss {loss.item():.3f} | val loss {val_loss():.3f}")

algo.finish()  # wait for the last all-reduce and apply it: all workers now agree
if master:
    tokens = args.steps * args.batch_size * args.block_size * world
    elapsed = time.perf_counter() - t0
    print(f"done | val loss {val_loss():.3f} | {tokens / elapsed:,.0f} tokens/s")
    print(f"communication per worker: {algo.stats.as_dict()}")
dist.destroy_process_group()
