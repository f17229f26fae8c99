"""A Lightning script made a lowcomm run by one callback: DiLoCo across the processes.

A small ``LlamaForCausalLM`` (built from ``LlamaConfig``, nothing downloaded) learns the text
that ships with Python, tokenized by a BPE tokenizer trained here (``text_data.py``), in an
ordinary ``LightningModule`` trained by ``lightning.Trainer`` with the DDP strategy; the
``LowcommCallback`` is the lowcomm in it.

Run it (CPU, 2 processes, gloo; from the repository root, after
``pip install -e '.[lightning,hf]'``, transformers and tokenizers for the model and tokenizer):

    torchrun --standalone --nproc-per-node 2 examples/lightning_diloco.py

and resume it from its last checkpoint (every rank continues exactly where it was):

    torchrun --standalone --nproc-per-node 2 examples/lightning_diloco.py --resume

torchrun's agent hosts its rendezvous store on every network interface of the machine, whatever
address ``--rdzv-endpoint`` names (``--standalone`` too; checked with ``ss -ltn`` on torch 2.13):
on a machine that others can reach, keep its ports behind a firewall, or run ``lowcomm train``,
whose launcher listens on 127.0.0.1 only.

Lightning can also start the processes itself: ``python examples/lightning_diloco.py``.
Other algorithms and settings: ``--algo co2``, ``--steps 480``, ``--data my_texts/``.
"""

from __future__ import annotations

import argparse
import glob
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import LlamaForCausalLM

from lowcomm.integrations.lightning import LowcommCallback
from lowcomm.train.config import TrainConfig
from text_data import small_llama, text_datasets

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--algo", default="diloco", help="a lowcomm algorithm (diloco, co2, ...)")
parser.add_argument("--sync-every", type=int, default=12, help="H: inner steps per round")
parser.add_argument("--steps", type=int, default=240, help="optimizer steps per process")
parser.add_argument("--data", default=None, help="text file or folder; default: Python's help")
parser.add_argument("--out", default="runs/lightning_diloco", help="checkpoints and logs")
parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
args = parser.parse_args()

block = 128
tokenizer, train, val = text_datasets(args.data, block=block)


class CausalLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = LlamaForCausalLM(small_llama(tokenizer.get_vocab_size(), block))

    def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
        return self.model(**batch).loss

    def validation_step(self, batch: dict[str, torch.Tensor], index: int) -> None:
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


torch.manual_seed(0)  # the same model on every process
module = CausalLM()
every = 5 * args.sync_every  # checkpoints and validation at round boundaries
# the settings `lowcomm train` tuned for this algorithm and length (docs/studies/convergence.md)
job = TrainConfig(algo=args.algo, steps=args.steps, sync_every=args.sync_every, n_layer=2)
trainer = pl.Trainer(
    accelerator="auto",
    devices=2,
    strategy="ddp",
    max_steps=args.steps,
    val_check_interval=every,
    check_val_every_n_epoch=None,
    limit_val_batches=8,
    log_every_n_steps=args.sync_every,
    default_root_dir=args.out,
    enable_progress_bar=False,
    callbacks=[
        LowcommCallback(args.algo, **job.algorithm_kwargs()),
        ModelCheckpoint(dirpath=os.path.join(args.out, "checkpoints"), every_n_train_steps=every),
    ],
)
loader = torch.utils.data.DataLoader(train, batch_size=8)
val_loader = torch.utils.data.DataLoader(val, batch_size=8)
last = sorted(glob.glob(os.path.join(args.out, "checkpoints", "*.ckpt")), key=os.path.getmtime)
trainer.fit(module, loader, val_loader, ckpt_path=last[-1] if args.resume and last else None)
final = trainer.validate(module, val_loader, verbose=False)[0]  # the model every rank agrees on
if trainer.is_global_zero:
    print(f"final val loss {final['val_loss']:.3f}; checkpoints in {args.out}")
if torch.distributed.is_initialized():  # leave together, the process group closed
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
