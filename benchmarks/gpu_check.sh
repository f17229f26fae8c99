#!/usr/bin/env bash
# lowcomm's GPU check, one command for a machine with CUDA GPUs:
#
#   bash benchmarks/gpu_check.sh
#
# 1. the GPUs (nvidia-smi -L) and the versions of torch, CUDA, cuDNN and NCCL;
# 2. the CUDA tests (python -m pytest -q tests/test_cuda.py);
# 3. the demo job (`lowcomm train`) with CO2 and with DDP, one GPU per worker
#    (--workers N, N the visible GPUs; with one GPU the one-worker forms: a real exchange, and
#    so a hidden fraction, needs two), over an emulated 100 Mbit/s link, 96 steps, each run in
#    a temporary folder; from each run's summary.json: tokens/s, the hidden fraction, the time
#    blocked per worker, each worker's peak GPU memory, whether the replicas ended identical.
#
# Every step runs under `timeout` (STEP_TIMEOUT seconds, 600 by default). Exit status: 0 when
# everything passed, 1 when something failed (the rest still runs; also when PYTHON cannot
# import torch), 2 at once when there is no CUDA device. Settings by environment: PYTHON (default python), STEP_TIMEOUT, STEPS (96),
# LINK (100mbit), OUT (the runs' folder; default a new one under $TMPDIR).

set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
STEP_TIMEOUT=${STEP_TIMEOUT:-600}
STEPS=${STEPS:-96}
LINK=${LINK:-100mbit}
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT" || exit 1

if ! gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null); then
    echo "gpu_check: cannot import torch with PYTHON=$PYTHON; set PYTHON to the environment lowcomm is installed in" >&2
    exit 1
fi
gpus=$(printf '%s\n' "$gpus" | tail -n 1)
case $gpus in '' | *[!0-9]*) gpus=0 ;; esac
if [ "$gpus" -lt 1 ]; then
    echo "gpu_check: no CUDA device (torch.cuda.is_available() is False for $PYTHON); run it on a machine with a GPU and a CUDA build of torch" >&2
    exit 2
fi

failed=0
fail() {
    echo "FAILED: $*"
    failed=1
}

echo "== devices"
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout "$STEP_TIMEOUT" nvidia-smi -L || fail "nvidia-smi -L"
else
    echo "nvidia-smi: not found"
fi
timeout "$STEP_TIMEOUT" "$PYTHON" - <<'EOF' || fail "torch versions"
import torch

nccl = torch.cuda.nccl.version()
nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
print(
    f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
    f"cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}"
)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB")
EOF

echo
echo "== CUDA tests: python -m pytest -q tests/test_cuda.py"
timeout "$STEP_TIMEOUT" "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py || fail "tests/test_cuda.py"

OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/lowcomm-gpu-check.XXXXXX")}
workers=$gpus
echo
echo "== demo job: $workers worker(s), one GPU each, --link $LINK (emulated), --steps $STEPS; runs in $OUT"
if [ "$workers" -lt 2 ]; then
    echo "one GPU visible: running the 1-worker forms; the multi-worker runs (a real exchange over the link, so a hidden fraction) need 2 GPUs"
fi

summarise() {
    "$PYTHON" - "$1" <<'EOF'
import json
import sys

s = json.load(open(sys.argv[1], encoding="utf-8"))
comm = s.get("comm_mean") or {}


def show(value, fmt):
    return "n/a" if value is None else format(value, fmt)


peaks = s.get("peak_gpu_memory_bytes")
memory = "n/a" if not peaks else " / ".join(
    "n/a" if p is None else f"{p / 2**20:.0f} MiB" for p in peaks
)
print(f"  status            {s.get('status')}")
print(f"  tokens/s          {show(s.get('tokens_per_s'), ',.0f')}")
print(f"  hidden fraction   {show(comm.get('hidden_fraction'), '.1%')} (mean of the workers)")
print(f"  blocked           {show(comm.get('blocked_s'), '.2f')} s per worker (mean)")
print(f"  peak GPU memory   {memory} (per worker)")
print(f"  replicas equal    {s.get('replicas_identical')}")
print(f"  val loss          {s['val_loss_initial']:.3f} -> {s['val_loss_final']:.3f}")
ok = s.get("status") == "finished" and s.get("replicas_identical")
sys.exit(0 if ok else 1)
EOF
}

for algo in co2 ddp; do
    out="$OUT/$algo-${workers}w"
    echo
    echo "-- $algo: lowcomm train --algo $algo --workers $workers --steps $STEPS --link $LINK --out $out"
    if timeout "$STEP_TIMEOUT" "$PYTHON" -m lowcomm train --algo "$algo" --workers "$workers" \
        --steps "$STEPS" --link "$LINK" --backend nccl --out "$out" --quiet; then
        summarise "$out/summary.json" || fail "$algo: not finished with identical replicas"
    else
        fail "$algo run (exit status $?)"
    fi
done

echo
if [ "$failed" -ne 0 ]; then
    echo "gpu_check: FAILED (see above); runs in $OUT"
    exit 1
fi
echo "gpu_check: passed; runs in $OUT"
