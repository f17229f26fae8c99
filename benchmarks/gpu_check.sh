#!/usr/bin/env bash
# lowcomm's GPU check for the machines that exist: one GPU (an H100 or an H200), at most
# 8 minutes in all. From the repository root:
#
#   bash benchmarks/gpu_check.sh
#
# 1. the GPU(s) and the versions of torch, CUDA, cuDNN and NCCL;
# 2. the CUDA tests (python -m pytest tests/test_cuda.py): with one GPU the two-worker tests run
#    with both workers sharing it over gloo;
# 3. the overhead table (../shared/gpu/overhead_table.sh's runs): `lowcomm train` with
#    --algo none, ddp, co2 and diloco with the job's defaults, co2 --compression int4
#    --sync-warmup 0, then none again; each run's tokens/s as a fraction of the ceiling measured
#    in the same call (the two `none` runs, before and after), in three sets, in this order:
#      1w       one worker, a 12x768 GPT (block 256, batch 32) in bf16, STEPS steps;
#      2w-link  two workers sharing the GPU over an emulated LINK (100 Mbit/s) link, the job's
#               default model (0.83 M parameters: ddp's all-reduce of every step fits the
#               budget on that link) in bf16, LINK_STEPS steps;
#      2w       two workers sharing the GPU over gloo (worker k on cuda:k mod 1), the 12x768 GPT;
#      offload  ZO2's offloading (benchmarks/zo_offload.py): MeZO's blockwise step on a 24x2048
#               GPT (fp32, batch 16 x 1024) with the blocks streamed from pinned host memory
#               against the model resident, side by side (tokens/s, peak GPU memory,
#               bit-identical), then the largest GPT of 24 blocks that fits offloaded, by the
#               planner's counts, run for 2 steps; under OFFLOAD_TIMEOUT;
#    and bf16 against fp32: the 1w `none` run again in fp32 (tokens/s, peak memory, val loss).
#    Before them, one short run that is not counted: the first job on a fresh machine loads
#    its kernels and libraries (at 35f5d43 on an H200 the first `none` ran at 0.70 of the
#    second, 45 against 32 ms a step);
# 4. a summary table: every run's tokens/s, fraction of its set's ceiling, hidden fraction,
#    time blocked, peak GPU memory, final val loss, whether the replicas ended identical.
#
# Every command runs under `timeout`: the tests under TEST_TIMEOUT, each run under RUN_TIMEOUT,
# both cut to what is left of BUDGET (480 s from the start); a run that no longer fits is not
# started and the summary says so. Exit status: 0 when the tests passed and every run that was
# started finished (with identical replicas where there are two workers), 1 otherwise (the rest
# still runs; also when PYTHON cannot import torch), 2 at once when there is no CUDA device.
#
# Settings by environment: PYTHON (default python), BUDGET (480), TEST_TIMEOUT (300),
# RUN_TIMEOUT (120), STEPS (96), LINK (100mbit), LINK_STEPS (96), OUT (the runs' folder;
# default a new one under $TMPDIR), TESTS (the pytest arguments; default tests/test_cuda.py),
# OFFLOAD_TIMEOUT (180), OFFLOAD_ARGS (zo_offload.py's arguments; default its own),
# SETS (the sets to run, of "1w 2w-link 2w offload", in that order; default all four: at 35f5d43 a run
# took about 30 s on an H200, most of it start-up, so the three sets and the tests take about
# 10 minutes: give BUDGET=600, or run the sets in two calls).
# GPU_CHECK_CPU=1 rehearses the whole script on the CPU (--device cpu, a 2x32 model, 8 steps,
# no GPU needed): the same commands, parsing and table, under a budget of 1200 s unless BUDGET
# is given (about 5 minutes on 2 cores, most of it the 19 runs' start-up).

set -uo pipefail

START=$SECONDS
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
CPU_REHEARSAL=${GPU_CHECK_CPU:-0}
BUDGET=${BUDGET:-$([ "$CPU_REHEARSAL" = 1 ] && echo 1200 || echo 480)}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
RUN_TIMEOUT=${RUN_TIMEOUT:-120}
STEPS=${STEPS:-96}
LINK=${LINK:-100mbit}
LINK_STEPS=${LINK_STEPS:-96}
TESTS=${TESTS:-tests/test_cuda.py}
OFFLOAD_TIMEOUT=${OFFLOAD_TIMEOUT:-180}
OFFLOAD_ARGS=${OFFLOAD_ARGS:-}
SETS=${SETS:-1w 2w-link 2w offload}
for set_ in $SETS; do
    case $set_ in 1w | 2w | 2w-link | offload) ;; *)
        echo "gpu_check: SETS has '$set_'; the sets are 1w, 2w-link, 2w and offload" >&2
        exit 1
        ;;
    esac
done
wants() { case " $SETS " in *" $1 "*) return 0 ;; esac; return 1; }
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT" || exit 1

if ! gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null); then
    echo "gpu_check: cannot import torch with PYTHON=$PYTHON; set PYTHON to the environment lowcomm is installed in" >&2
    exit 1
fi
gpus=$(printf '%s\n' "$gpus" | tail -n 1)
case $gpus in '' | *[!0-9]*) gpus=0 ;; esac
if [ "$gpus" -lt 1 ] && [ "$CPU_REHEARSAL" != 1 ]; then
    echo "gpu_check: no CUDA device (torch.cuda.is_available() is False for $PYTHON); run it on a machine with a GPU and a CUDA build of torch (GPU_CHECK_CPU=1 rehearses it on the CPU)" >&2
    exit 2
fi

# the models and flags of the three sets
BIG="--n-layer 12 --n-head 12 --n-embd 768 --block-size 256 --batch-size 32"
SMALL=""  # the job's default model
COMMON="--eval-every 100000 --quiet"
DEVICE=""
if [ "$CPU_REHEARSAL" = 1 ]; then
    BIG="--n-layer 2 --n-head 2 --n-embd 32 --block-size 16 --batch-size 2"
    SMALL="$BIG"
    STEPS=8
    LINK_STEPS=8
    COMMON="$COMMON --eval-batches 1 --sync-every 4"
    DEVICE="--device cpu"
    [ -z "$OFFLOAD_ARGS" ] && OFFLOAD_ARGS="--device cpu --layers 3 --embd 32 --heads 2 --seq 16 --batch 2 --steps 1 --width-step 32 --max-params 1.2e5 --largest-steps 1"
fi
# two workers share one GPU: on a machine with more, the first one visible
SHARED_GPU=""
if [ "$CPU_REHEARSAL" != 1 ] && [ "$gpus" -gt 1 ]; then
    SHARED_GPU=${CUDA_VISIBLE_DEVICES:-0}
    SHARED_GPU=${SHARED_GPU%%,*}
fi

OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/lowcomm-gpu-check.XXXXXX")}
mkdir -p "$OUT" || exit 1
RESULTS="$OUT/results.jsonl"
: >"$RESULTS"

failed=0
fail() {
    echo "FAILED: $*"
    failed=1
}

left() { echo $((BUDGET - (SECONDS - START))); }

# bounded LIMIT: LIMIT cut to what is left of the budget, at least 1 (timeout 0 would be none)
bounded() {
    local limit=$1 rest
    rest=$(left)
    [ "$rest" -lt "$limit" ] && limit=$rest
    [ "$limit" -lt 1 ] && limit=1
    echo "$limit"
}

echo "== devices (budget ${BUDGET}s; runs in $OUT)"
if [ "$CPU_REHEARSAL" = 1 ]; then
    echo "GPU_CHECK_CPU=1: a rehearsal on the CPU (--device cpu, a 2x32 model, $STEPS steps): the figures mean nothing"
elif command -v nvidia-smi >/dev/null 2>&1; then
    timeout 30 nvidia-smi -L || fail "nvidia-smi -L"
else
    echo "nvidia-smi: not found"
fi
timeout 60 "$PYTHON" - <<'EOF' || fail "torch versions"
import torch

nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
print(
    f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
    f"cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}"
)
for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB")
EOF

echo
echo "== CUDA tests: python -m pytest -q $TESTS"
tests_status="passed"
limit=$(bounded "$TEST_TIMEOUT")
# shellcheck disable=SC2086  # TESTS is a list of pytest arguments
timeout "$limit" "$PYTHON" -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/tests.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
    tests_status="FAILED (exit status $rc$([ "$rc" -eq 124 ] && echo ", timed out after ${limit}s"))"
    fail "$TESTS"
fi
tests_line=$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$OUT/tests.log" | tail -n 1 | tr -d '=' | sed 's/^ *//; s/ *$//')

# run SET NAME ENV -- FLAGS...: one `lowcomm train` run of set SET, recorded in $RESULTS
run() {
    local set=$1 name=$2 env=$3
    shift 4
    local out="$OUT/$set-$name" limit rc
    limit=$(bounded "$RUN_TIMEOUT")
    if [ "$limit" -lt 15 ]; then
        echo "-- $set $name: not started, ${limit}s of the budget left"
        printf '{"set": "%s", "run": "%s", "skipped": "budget"}\n' "$set" "$name" >>"$RESULTS"
        return
    fi
    echo "-- $set $name: lowcomm train $* --out $out"
    # shellcheck disable=SC2086  # env is a list of NAME=VALUE words, or empty
    env $env timeout "$limit" "$PYTHON" -m lowcomm train "$@" --out "$out" >"$out.log" 2>&1
    rc=$?
    if [ "$rc" -ne 0 ]; then
        tail -n 5 "$out.log"
        [ "$rc" -eq 124 ] && echo "   (timed out after ${limit}s)"
    fi
    "$PYTHON" - "$set" "$name" "$out" "$rc" "$limit" >>"$RESULTS" <<'EOF'
import json
import os
import sys

set_, name, out, rc, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
row = {"set": set_, "run": name, "rc": rc, "limit_s": int(limit)}
try:
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        s = json.load(f)
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        resolved = json.load(f).get("resolved", {})
except (OSError, ValueError):
    s, resolved = None, {}
if s is not None:
    comm = s.get("comm_mean") or {}
    row.update(
        status=s.get("status"),
        workers=s.get("workers"),
        backend=resolved.get("backend"),
        tokens_per_s=s.get("tokens_per_s"),
        hidden_fraction=comm.get("hidden_fraction"),
        blocked_s=comm.get("blocked_s"),
        peak_gpu_memory_bytes=s.get("peak_gpu_memory_bytes"),
        val_loss_initial=s.get("val_loss_initial"),
        val_loss_final=s.get("val_loss_final"),
        replicas_identical=s.get("replicas_identical"),
    )
print(json.dumps(row))
EOF
    "$PYTHON" - "$RESULTS" <<'EOF' || fail "$set $name"
import json
import sys

row = [json.loads(line) for line in open(sys.argv[1], encoding="utf-8")][-1]
ok = row.get("rc") == 0 and row.get("status") == "finished"
if ok and (row.get("workers") or 1) > 1 and not row["run"].startswith("none"):
    ok = bool(row.get("replicas_identical"))  # (`none` never syncs: its replicas differ)
if row.get("tokens_per_s") is not None:
    same = ""
    if not row["run"].startswith("none"):
        same = f", replicas identical: {row.get('replicas_identical')}"
    val = row.get("val_loss_final")  # none in the summary of a run stopped early
    val = "-" if val is None else f"{val:.3f}"
    print(f"   {row['tokens_per_s']:,.0f} tokens/s, {row.get('backend')}, val {val}{same}")
sys.exit(0 if ok else 1)
EOF
}

# table SET ENV -- FLAGS...: the overhead table's runs in one set
table() {
    local set=$1 env=$2
    shift 3
    run "$set" none "$env" -- "$@" --algo none
    run "$set" ddp "$env" -- "$@" --algo ddp
    run "$set" co2 "$env" -- "$@" --algo co2
    run "$set" diloco "$env" -- "$@" --algo diloco
    run "$set" co2-int4-nowarm "$env" -- "$@" --algo co2 --compression int4 --sync-warmup 0
    run "$set" none-again "$env" -- "$@" --algo none
}

shared_env=""
[ -n "$SHARED_GPU" ] && shared_env="CUDA_VISIBLE_DEVICES=$SHARED_GPU"

if [ -n "$(printf '%s' "$SETS" | tr -d '[:space:]' | sed 's/offload//g')" ]; then
    echo
    echo "== warm-up: one short run, not counted (a fresh machine loads its kernels on the first)"
    # shellcheck disable=SC2086  # BIG, COMMON and DEVICE are lists of flags
    run warmup none "" -- --workers 1 --steps 16 $BIG $COMMON $DEVICE --precision bf16 --algo none
fi

if wants 1w; then
    echo
    echo "== overhead table 1w: one worker, --steps $STEPS, bf16"
    # shellcheck disable=SC2086
    table 1w "" -- --workers 1 --steps "$STEPS" $BIG $COMMON $DEVICE --precision bf16
    # shellcheck disable=SC2086
    run 1w none-fp32 "" -- --workers 1 --steps "$STEPS" $BIG $COMMON $DEVICE --precision fp32 --algo none
fi

if wants 2w-link; then
    echo
    echo "== overhead table 2w-link: two workers sharing one GPU over an emulated --link $LINK, --steps $LINK_STEPS, bf16"
    # shellcheck disable=SC2086
    table 2w-link "$shared_env" -- --workers 2 --steps "$LINK_STEPS" $SMALL $COMMON $DEVICE --precision bf16 --link "$LINK"
fi

if wants 2w; then
    echo
    echo "== overhead table 2w: two workers sharing one GPU (gloo), --steps $STEPS, bf16"
    # shellcheck disable=SC2086
    table 2w "$shared_env" -- --workers 2 --steps "$STEPS" $BIG $COMMON $DEVICE --precision bf16
fi

offload_status="not run"
if wants offload; then
    echo
    echo "== offload: python benchmarks/zo_offload.py $OFFLOAD_ARGS"
    limit=$(bounded "$OFFLOAD_TIMEOUT")
    if [ "$limit" -lt 15 ]; then
        offload_status="not started, ${limit}s of the budget left"
    else
        # shellcheck disable=SC2086  # OFFLOAD_ARGS is a list of arguments
        timeout "$limit" "$PYTHON" benchmarks/zo_offload.py $OFFLOAD_ARGS 2>&1 | tee "$OUT/offload.log"
        rc=${PIPESTATUS[0]}
        if [ "$rc" -eq 0 ]; then
            offload_status="passed"
        else
            offload_status="FAILED (exit status $rc$([ "$rc" -eq 124 ] && echo ", timed out after ${limit}s"))"
            fail "benchmarks/zo_offload.py"
        fi
    fi
fi

echo
echo "== summary (${SECONDS}s of the ${BUDGET}s budget used$([ "$CPU_REHEARSAL" = 1 ] && echo '; a CPU rehearsal: the figures mean nothing'))"
echo "CUDA tests: $tests_status${tests_line:+: $tests_line}"
echo "offload: $offload_status$([ -f "$OUT/offload.log" ] && grep -E '^(offloaded bit|tokens/s offloaded|peak device|largest)' "$OUT/offload.log" | sed 's/^/; /' | tr -d '\n')"
"$PYTHON" - "$RESULTS" <<'EOF' || fail "the summary table"
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1], encoding="utf-8")]
SETS = {
    "1w": "one worker",
    "2w-link": "two workers sharing the GPU, emulated link",
    "2w": "two workers sharing the GPU",
}


def num(v, fmt):
    return "-" if v is None else format(v, fmt)


print(
    f"{'set':8} {'run':16} {'tokens/s':>10} {'of ceiling':>11} {'hidden':>7} {'blocked':>8} "
    f"{'peak GPU MiB':>13} {'val':>6} {'backend':>20} {'replicas':>8}"
)
for set_, title in SETS.items():
    mine = [r for r in rows if r["set"] == set_]
    if not mine:
        continue
    ceiling = [
        r["tokens_per_s"]
        for r in mine
        if r["run"] in ("none", "none-again") and r.get("tokens_per_s")
    ]
    for r in mine:
        if "skipped" in r:
            print(f"{set_:8} {r['run']:16} not started: over the budget")
            continue
        tps = r.get("tokens_per_s")
        if tps is None:
            print(f"{set_:8} {r['run']:16} failed (exit status {r['rc']}, limit {r['limit_s']}s)")
            continue
        if ceiling and r["run"] != "none-fp32":
            lo, hi = tps / max(ceiling), tps / min(ceiling)
            frac = f"{lo:.2f}" if abs(hi - lo) < 0.005 else f"{lo:.2f}-{hi:.2f}"
        else:
            frac = "-"
        peaks = r.get("peak_gpu_memory_bytes")
        peak = "-" if not peaks else "/".join(num(p and p / 2**20, ".0f") for p in peaks)
        identical = None if r["run"].startswith("none") else r.get("replicas_identical")
        print(
            f"{set_:8} {r['run']:16} {tps:>10,.0f} {frac:>11} "
            f"{num(r.get('hidden_fraction'), '.0%'):>7} {num(r.get('blocked_s'), '.2f'):>8} "
            f"{peak:>13} {num(r.get('val_loss_final'), '.3f'):>6} "
            f"{str(r.get('backend')):>20} {'-' if identical is None else str(identical):>8}"
        )
by_run = {(r["set"], r["run"]): r for r in rows}
bf16, fp32 = by_run.get(("1w", "none"), {}), by_run.get(("1w", "none-fp32"), {})
if bf16.get("tokens_per_s") and fp32.get("tokens_per_s"):
    print(
        f"bf16 against fp32 (1w, --algo none): {bf16['tokens_per_s'] / fp32['tokens_per_s']:.2f}x "
        f"the tokens/s, val {num(bf16.get('val_loss_final'), '.3f')} against "
        f"{num(fp32.get('val_loss_final'), '.3f')}"
    )
print("fractions: tokens/s over the set's two `none` runs (the higher and the lower ceiling)")
EOF

echo
if [ "$failed" -ne 0 ]; then
    echo "gpu_check: FAILED (see above); runs in $OUT"
    exit 1
fi
echo "gpu_check: passed; runs in $OUT"
