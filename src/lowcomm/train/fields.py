"""The fields of the ``lowcomm train`` job: the dataclass :class:`TrainFields` that
:class:`~lowcomm.train.config.TrainConfig` is (every field with the text its ``--help`` shows,
the outer hyperparameters added by :func:`~.outer_keys.with_outer_fields`), the values some of
them may take, and the node layout derived from them. Filling and checking them is
:mod:`lowcomm.train.config`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lowcomm.registry import BASELINES, names
from lowcomm.train.outer_keys import with_outer_fields

__all__ = [
    "ALGORITHM_CHOICES",
    "DEFAULT_WORKERS",
    "DEVICES",
    "NODE_SHARDING",
    "NO_OUTER_ALGORITHM",
    "OPTIMIZERS",
    "PRECISIONS",
    "TrainFields",
]

ALGORITHM_CHOICES = names()
"""Values of ``--algo`` (:mod:`lowcomm.registry`); ``ddp`` is the synchronous
DistributedDataParallel baseline."""

NO_OUTER_ALGORITHM = BASELINES
"""``--algo`` values without a lowcomm algorithm: the DDP baseline, and ``none``, the no-sync
ceiling (the same workers training with no communication at all, for throughput comparisons)."""

NODE_SHARDING = ("none", "zero")
"""Values of ``--node-sharding``: how the processes of a node hold the inner AdamW state."""

DEFAULT_WORKERS = 2
"""Worker processes when neither ``workers`` nor ``procs_per_node`` is set (one node)."""

DEVICES = ("auto", "cpu", "cuda")
"""Values of ``--device``: where the workers compute
(:func:`lowcomm.train.worker.place_workers`)."""

OPTIMIZERS = ("adamw", "muon")
PRECISIONS = ("fp32", "bf16")


@dataclass(kw_only=True)
@with_outer_fields
class TrainFields:
    """The fields of :class:`~lowcomm.train.config.TrainConfig` and the node layout derived
    from them (resolved by its checks)."""

    if TYPE_CHECKING:  # the outer hyperparameters, added by with_outer_fields

        def __getattr__(self, name: str) -> Any: ...

    # --- job -------------------------------------------------------------------------------
    algo: str = "co2"
    """The algorithm: a name of :data:`lowcomm.registry.REGISTRY` (``lowcomm train --help``
    lists them with a line each)."""
    workers: int | None = None
    """Local worker processes to launch (default 2; with nodes, nodes x procs_per_node). Under
    torchrun, which sets the world size, it is ignored (with nodes, checked against it)."""
    nodes: int = 1
    """K: node groups; from 2 on, each node's processes train one replica with DDP inside the
    node and the algorithm runs across nodes (1: every worker its own replica)."""
    procs_per_node: int | None = None
    """M: processes per node (ranks node-major: node n holds n*M ... n*M+M-1); unset: workers /
    nodes."""
    node_sharding: str = "none"
    """Inside a node: "none" (every process holds the whole AdamW state) or "zero" (AdamW state
    sharded across the node's processes with ZeroRedundancyOptimizer)."""
    steps: int = 960
    """Inner optimizer steps per worker."""
    sync_every: int = 12
    """H: inner steps per communication round (not used by ddp, which syncs every step)."""
    seed: int = 0
    """Seed for the model initialisation (same on every rank) and the data order (per rank)."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl when every local worker has a GPU of its own, else
    gloo), gloo or nccl (GPU collectives on NCCL, the few CPU control tensors on gloo: process
    groups cpu:gloo,cuda:nccl). With fewer GPUs than workers, or gloo, worker k runs on GPU
    k mod G and gloo carries its CUDA tensors (through pinned host memory)."""
    device: str = "auto"
    """Where the workers compute: auto (the GPUs when CUDA is available, else the CPU), cuda
    or cpu (CPU workers on a machine with GPUs)."""
    bucket_cap_mb: float = 25.0
    """Size of the flat communication buckets, in MiB (one collective per bucket)."""

    link: str | None = None
    """Emulated slow link for every collective: a profile (rdma-800g, tcp-80g, 1gbit, 100mbit,
    10mbit) or RATE:LATENCY such as 100mbit:20ms; unset: the real network."""
    tune_link: str = "auto"
    """Choose the outer sync's codec and overlap (and the warm start's codec) from the link, for
    the settings not given: auto (the emulated --link; the real network measured under torchrun;
    nothing on one machine), measure (always time the real network), off, or a link profile or
    RATE:LATENCY to choose as if on that link without emulating it."""

    # --- data ------------------------------------------------------------------------------
    data: str | None = None
    """UTF-8 text file (a .jsonl file: one {"text": ...} document per line) or folder of such
    files (.txt, .md, .rst, .jsonl; byte-level tokens); unset: the embedded corpus."""
    batch_size: int = 16
    """Sequences per worker per inner step."""
    block_size: int = 64
    """Tokens per sequence (the model's context length)."""

    # --- documents (variable-length work; lowcomm.balance) -----------------------------------
    documents: bool = False
    """Train on whole documents instead of fixed windows: each step a worker draws exactly
    batch_size x block_size tokens of documents (pieces of at most block_size), packed with
    block-diagonal causal attention and assigned to ranks by --balance. --data: a folder (one
    document per file, one per line of its .jsonl files), a .jsonl file ("text" per line) or a
    text file (blank-line separated); unset: the Python standard library's source files."""
    balance: str = "cost"
    """With documents: how documents are assigned to ranks: sequential (each keeps what it
    drew), random, length (group by length), tokens (equal tokens), cost (equal predicted
    compute time), cost+split (also split a document whose cost exceeds the fair share over
    several ranks, where the link makes it pay) or remap (the linear layers on equal runs of
    tokens, attention on whole documents balanced by s², activations exchanged every layer;
    DDP on one node, no dropout). Outer algorithms balance a whole round, ddp
    every step. A comma-separated list is taken in turn per step or round (to compare them
    side by side: training does not depend on it)."""
    balance_paired: bool = False
    """With a list of assignments: give each assignment of a turn the same documents (every
    drawn step or round is trained once per assignment), so they are compared on identical
    work; for measurements."""
    balance_method: str = "lpt"
    """With documents: the partitioning of tokens and cost balancing: lpt or kk
    (Karmarkar-Karp)."""
    token_cap: int | None = None
    """With documents: most tokens one rank trains on in a step (memory); unset: twice
    batch_size x block_size. At least batch_size x block_size + block_size."""
    cost_model: str = "fit"
    """With documents: the cost model the planner balances: fit (time this model's forward and
    backward at several lengths on every rank at start-up) or analytic (FLOP counts)."""
    cost_refit: int = 8
    """With documents and the fitted cost model: refit it online after every plan unit from
    the compute times every rank measured in the last this-many units (with the start-up
    timings), the same fit on every rank; 0: fit once at start-up."""
    busy_wait: bool = False
    """Wait for collectives by polling instead of sleeping, so that a waiting worker keeps its
    share of a CPU shared by several workers (emulates one device per worker on an
    oversubscribed host; for measurements)."""
    speeds: str | list[float] | None = None
    """Emulate workers of unequal speed: one relative speed per worker, comma-separated
    (1,1,1,0.5: the last at half speed) or a TOML list. A worker slower than the fastest
    stretches each of its inner steps by computing (a busy loop) for (fastest / its speed - 1)
    times the step's own measured time, so that it keeps its share of the CPU as a slower
    device would; for measurements. Unset: every worker as it is."""

    # --- model -----------------------------------------------------------------------------
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability (0 disables it)."""

    precision: str = "fp32"
    """Arithmetic of the forward and backward: "fp32", or "bf16" (torch.autocast: matrix
    multiplications and attention in bfloat16, reductions, norms and the loss in fp32; the
    weights, their gradients, the inner optimizer's state and every outer algorithm's anchors
    and pseudo-gradients stay fp32). Validation runs in fp32."""

    # --- inner optimizer (AdamW) -----------------------------------------------------------
    optimizer: str = "adamw"
    """Inner optimizer: "adamw", or "muon" (torch.optim.Muon on the blocks' weight matrices,
    its update scaled to AdamW's RMS so it takes the same lr and weight decay; AdamW on
    embeddings, biases and norm gains: lowcomm.optim.MuonAdamW)."""
    lr: float = 2e-3
    """Inner learning rate (after warm-up)."""
    warmup: int = 30
    """Inner steps of linear learning-rate warm-up from 0."""
    lr_schedule: str = "cosine"
    """After warm-up: "cosine" (decay to min_lr_ratio * lr at the last step) or "constant"."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of lr."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to weight matrices and embeddings only."""

    # --- outer hyperparameters: one field per keyword of the algorithms' dataclasses,
    # inserted here by _with_outer_fields (None = the algorithm's default) -----------------

    # --- evaluation and output -------------------------------------------------------------
    eval_every: int = 60
    """Inner steps between validation evaluations, rounded up to a multiple of sync_every."""
    eval_batches: int = 8
    """Validation batches per evaluation."""
    log_every: int = 10
    """Inner steps per training-loss record (their mean) and progress-bar update."""
    out: str | None = None
    """Output folder; unset: runs/<name>/."""
    overwrite: bool = False
    """Replace the files of a previous run in the output folder (refused otherwise)."""
    tensorboard: str | None = None
    """Also write lowcomm's scalars (lowcomm/loss, val_loss, pseudo_grad_norm, bytes sent and
    received, time blocked, hidden fraction, skipped updates) as TensorBoard event files to
    this folder, with the outer step as their x-axis (rank 0's; needs lowcomm[tensorboard])."""
    quiet: bool = False
    """Workers log warnings only: no progress bar, no start-up or per-evaluation lines."""
    ceiling_steps: int = 0
    """Also time this many inner steps with no synchronisation at all, on a copy of the model in
    the same worker processes (in segments of 2 steps interleaved with training: the first
    before it, the last after it, the others spread over the run where no sync is in flight,
    each rank on its own; the slowest rank's time counts), and report throughput as a share of
    that ceiling (0: off)."""
    name: str | None = None
    """Run name; unset: <algo>-<YYYYmmdd-HHMMSS>."""

    # --- checkpoints and failures ----------------------------------------------------------
    checkpoint_every: int = 0
    """Inner steps between resumable checkpoints of every rank's state, written to
    <out>/checkpoints/step-NNNNNN/ (0: none)."""
    keep_checkpoints: int = 3
    """Complete checkpoints to keep, the newest (older ones are deleted)."""
    resume: str | None = None
    """Resume from a checkpoint: a step-NNNNNN folder, a run folder, or (--resume alone) the
    latest complete checkpoint under --out. The settings must match the checkpoint's."""
    max_restarts: int = 0
    """Restart the worker group this many times after a worker fails, each time from the latest
    complete checkpoint (local launch; under torchrun use its own --max-restarts)."""
    collective_timeout: float = 600.0
    """Seconds a collective may wait for a peer before the worker fails: bounds how long the
    others hang when a worker dies or stalls (raise it for big models on slow links)."""

    # --- elastic replicas (lowcomm[ft]) -------------------------------------------------------
    fault_tolerance: bool = False
    """Run every worker as a replica of its own on torchft: one that dies is left out of the
    next sync and restarted alone (up to max_restarts times each), then healed from a live one;
    the others keep training. Starts a Lighthouse on 127.0.0.1 unless lighthouse is given."""
    min_replicas: int = 1
    """With fault_tolerance: a sync needs at least this many replicas (fewer wait for more)."""
    lighthouse: str | None = None
    """With fault_tolerance: join the Lighthouse at this address (http://HOST:PORT) as the one
    replica replica_id, instead of starting a Lighthouse and every replica here."""
    replica_id: str | None = None
    """With lighthouse: this replica's name, the same when it is restarted (replica_3)."""

    @property
    def world_size(self) -> int:
        """Processes of the job on a local launch: ``workers`` (``nodes`` x ``procs_per_node``
        with several nodes); torchrun's world size must equal it when ``nodes`` > 1."""
        assert self.workers is not None, "resolved in __post_init__"
        return self.workers

    @property
    def replicas(self) -> int:
        """With fault_tolerance, the replicas ``lowcomm train`` starts: one per node with node
        groups (``nodes``), else one per worker."""
        return self.nodes if self.nodes > 1 else self.world_size

    @property
    def procs_per_replica(self) -> int:
        """With fault_tolerance, the processes that train one replica together (DDP inside
        it): ``procs_per_node`` with node groups, else 1."""
        return self.procs_per_node if self.nodes > 1 and self.procs_per_node else 1

    @property
    def hierarchical(self) -> bool:
        """Whether the job runs node groups: DDP inside each node, the algorithm across nodes
        (``nodes`` > 1 with an outer algorithm; ddp runs over every process)."""
        return self.nodes > 1 and self.algo not in NO_OUTER_ALGORITHM

    @property
    def node_size(self) -> int:
        """Processes that train one replica together (DDP, and ZeRO with ``node_sharding``):
        ``procs_per_node`` with node groups, every process for ddp on one node, else 1."""
        if self.nodes > 1 and self.algo != "none":
            assert self.procs_per_node is not None
            return self.procs_per_node
        return self.world_size if self.algo == "ddp" else 1
