"""A Hugging Face ``Trainer`` script made a lowcomm run by one line: CO2 across the processes.

A small ``LlamaForCausalLM`` (built from ``LlamaConfig``, nothing downloaded) learns the text
that ships with Python, tokenized by a BPE tokenizer trained here (``text_data.py``). The
script is an ordinary ``Trainer`` script; the ``attach`` line is the lowcomm in it (with the
settings ``lowcomm train`` tuned, which it takes from lowcomm's job configuration).

Run it (CPU, 2 processes, gloo; from the repository root, after ``pip install -e '.[hf]'``):

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py

and resume it from its last checkpoint (every rank continues exactly where it was):

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --resume

torchrun's agent hosts its rendezvous store on every network interface of the machine, whatever
address ``--rdzv-endpoint`` names (``--standalone`` too; checked with ``ss -ltn`` on torch 2.13):
on a machine that others can reach, keep its ports behind a firewall, or run ``lowcomm train``,
whose launcher listens on 127.0.0.1 only.

Other algorithms and settings: ``--algo diloco --sync-every 24``, ``--steps 480``,
``--data my_texts/``. On GPUs: ``torchrun --nproc-per-node 8 examples/hf_trainer.py`` (NCCL).
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import LlamaForCausalLM, Trainer, TrainingArguments

import lowcomm.integrations.hf
from lowcomm.train.config import TrainConfig
from text_data import small_llama, text_datasets

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--algo", default="co2", help="a lowcomm algorithm (co2, diloco, ...), or ddp")
parser.add_argument("--sync-every", type=int, default=12, help="H: inner steps per round")
parser.add_argument("--steps", type=int, default=240, help="optimizer steps per process")
parser.add_argument("--data", default=None, help="text file or folder; default: Python's help")
parser.add_argument("--out", default="runs/hf_trainer", help="the Trainer's output_dir")
parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
args = parser.parse_args()

block = 128
tokenizer, train, val = text_datasets(args.data, block=block)
torch.manual_seed(0)
model = LlamaForCausalLM(small_llama(tokenizer.get_vocab_size(), block))

cpu = not torch.cuda.is_available()
if cpu:  # processes on one machine share its cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", 1))))
every = 5 * args.sync_every  # saves and evaluations at round boundaries
training = TrainingArguments(
    output_dir=args.out,
    max_steps=args.steps,
    per_device_train_batch_size=8,
    learning_rate=1e-3,
    warmup_steps=args.sync_every,
    lr_scheduler_type="cosine",
    logging_steps=args.sync_every,
    eval_strategy="steps",
    eval_steps=every,
    save_steps=every,
    save_total_limit=2,
    per_device_eval_batch_size=8,
    report_to=[],
    use_cpu=cpu,
    ddp_backend="gloo" if cpu else None,
    disable_tqdm=True,
    seed=0,
)
trainer = Trainer(model=model, args=training, train_dataset=train, eval_dataset=val)
if args.algo != "ddp":  # --algo ddp: the same script without lowcomm, for comparison
    # the settings `lowcomm train` tuned for this algorithm and length
    # (docs/studies/convergence.md): here, outer Nesterov lr 0.5, a warm start of a quarter
    # of the steps, ...
    job = TrainConfig(algo=args.algo, steps=args.steps, sync_every=args.sync_every, n_layer=2)
    lowcomm.integrations.hf.attach(trainer, args.algo, **job.algorithm_kwargs())  # the line
trainer.train(resume_from_checkpoint=True if args.resume else None)
trainer.save_model()  # every rank holds the same model: the one the ranks agreed on
final = trainer.evaluate()  # every rank takes part
if trainer.is_world_process_zero():
    print(f"final eval loss {final['eval_loss']:.3f}; model in {args.out}")
if torch.distributed.is_initialized():  # leave together, the process group closed
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
