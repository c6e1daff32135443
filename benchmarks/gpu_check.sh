#!/usr/bin/env bash
# GPU checks of the engine-allocated CUDA weight store: one run of about 6 minutes on one GPU (a rerun
# fits the device time), failing fast, cheapest first, and failing when a CUDA test is skipped.
#   0. preflight (seconds): CUDA present, the project and its dependencies import, wheels installed;
#      exits 2 at once if not                                               -> preflight in summary.txt
#   1. cuda_quick: the in-process CUDA tests: own allocator segment per buffer (export refuses a
#      shared one), torch's IPC count untouched by successive importers (and freed without limbo),
#      a killed engine's buffer let go, the IPC export/import, the GPU state root, payloads, GPU
#      masters publishing, format 2's context pass on CUDA against numpy's     -> cuda_quick.log/.xml
#   2. codec_digest: the codec's torch path on the GPU (encode == host encode, apply bitwise, one host
#      copy of a dense tensor), the device digest (== blake3, peak scratch within its bound) and the
#      version fence with a reader that copies a 1 GB store on a side stream and never syncs, racing
#      writes (no torn copy may pass as consistent; the old fence's count is printed beside it)
#                                                                           -> bench.log, codec_digest.json
#   2b. format2: format 2's context pass on the GPU where the store lives: a format-2 patch of a 1 GiB
#      bf16 tensor applied on the GPU (no host copy of the base), bitwise against the target and the
#      host decode, its time against format 1's apply of the same pair on the GPU -> bench.log
#   3. cuda_system: the real daemon with the reference engine on the GPU (kill -9 of the daemon mid-
#      activation, kill -9 of the engine, bad registrations)                -> cuda_system.log/.xml
#   4. activation: the pause on a 14 GB bf16 model with 0.5% changed (goal <= 50 ms), the state
#      root on the GPU against blake3 on a host copy                        -> bench.log, activation.json
#   5. tp_ranks: tensor-parallel rank stores on CUDA: the real daemon feeding two engine-allocated rank
#      buffers on cuda:0 from a trained fp8 Qwen3-MoE (tests/system/test_hf_rank_daemon.py)
#                                                                           -> cuda_system.log
#   6. publish: publish latency of a 1.07B-parameter model, FP32 masters on the GPU -> bench.log
#   7. engines: vLLM and SGLang servers taking versions through patchswarm (skipped, one line each,
#      where they are not installed)                                       -> bench.log
# A junit check after each pytest step fails the run if any test was skipped or none ran.
# Results go to $OUT (default bench-out/gpu, at most 8 files); summary.txt has each step's exit status.
#
#   benchmarks/gpu_check.sh                 on the GPU machine
#   benchmarks/gpu_check.sh --tiny          anywhere: tiny sizes; without CUDA the GPU parts skip (allowed)
#   benchmarks/gpu_check.sh --dry-run       print the plan (steps, limits, commands) and exit
#   benchmarks/gpu_check.sh --fetch-wheels  here (pip reaches the index): the Python packages the GPU
#                                           image lacks, as py3.12 x86-64 wheels, into bench-out/wheels
# On the GPU machine the wheels in bench-out/wheels (carried there) are installed into /tmp/site.
# GPU_CHECK_BUDGET_S (default 360): the whole run's time; a step never runs past it (it is recorded
# as skipped, and the run fails).
set -u -o pipefail
cd "$(dirname "$0")/.."
WHEELS=bench-out/wheels
# What the GPU image (torch, numpy, aiohttp, msgpack, pytest, hypothesis, yaml, prometheus-client...)
# lacks of the project's and the tests' dependencies; versions as in this checkout's .venv.
NEED="blake3 zstandard cryptography cffi pycparser pytest-asyncio jsonschema jsonschema-specifications referencing rpds-py"
MODULES="blake3 zstandard cryptography cffi pycparser pytest_asyncio jsonschema jsonschema_specifications referencing rpds aiohttp msgpack numpy pytest hypothesis"

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p "$WHEELS"
    pins=$(.venv/bin/python -m pip freeze 2>/dev/null)
    for name in $NEED; do
        pin=$(echo "$pins" | grep -i "^${name}==" || echo "$name")
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform manylinux_2_34_x86_64 --platform any -d "$WHEELS" "$pin" || echo "could not fetch $pin"
    done
    ls -la "$WHEELS"
    exit 0
fi

TINY=0
DRY=0
for arg in "$@"; do
    case "$arg" in
    --tiny) TINY=1 ;;
    --dry-run) DRY=1 ;;
    *) echo "gpu_check.sh: unknown argument $arg (--tiny, --dry-run, --fetch-wheels)" >&2; exit 2 ;;
    esac
done
BUDGET=${GPU_CHECK_BUDGET_S:-360}
DEADLINE=$((SECONDS + BUDGET))
OUT=${OUT:-bench-out/gpu}
SUMMARY="$OUT/summary.txt"
FAILED=0
if [ "$DRY" = 0 ]; then
    mkdir -p "$OUT"
    : >"$SUMMARY"
    if ls "$WHEELS"/*.whl >/dev/null 2>&1 && [ ! -x .venv/bin/python ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site || echo "wheel install failed" | tee -a "$SUMMARY"
    fi
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

step() { # step NAME LIMIT_S LOG CMD...: run within the limit and what is left of the budget, log, record
    local name=$1 limit=$2 log=$3
    shift 3
    local left=$((DEADLINE - SECONDS))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$DRY" = 1 ]; then
        echo "step $name limit=${limit}s log=$log: $*"
        return 0
    fi
    if [ "$limit" -lt 10 ]; then
        echo "$name: skipped (the ${BUDGET} s budget is spent)" | tee -a "$SUMMARY"
        FAILED=1
        return 0
    fi
    local t0=$SECONDS
    echo "=== $name" >>"$OUT/$log"
    timeout --kill-after=10 "$limit" "$@" >>"$OUT/$log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - t0)) s" | tee -a "$SUMMARY"
    [ "$rc" = 0 ] || FAILED=1
    tail -n 20 "$OUT/$log"
}

ran_all() { # ran_all NAME XML: fail the run if a test of that pytest step was skipped or none ran
    local name=$1 xml=$2
    if [ "$DRY" = 1 ]; then
        echo "check ${name}_skips: $PY -m benchmarks.gpu_junit $xml"
        return 0
    fi
    local text rc
    text=$("$PY" -m benchmarks.gpu_junit "$xml" 2>&1)
    rc=$?
    if [ "$TINY" = 1 ]; then
        echo "${name}_skips: not checked with --tiny ($(echo "$text" | grep -c skipped) skipped)" | tee -a "$SUMMARY"
        return 0
    fi
    echo "$text" | head -n 20
    echo "${name}_skips: exit $rc" | tee -a "$SUMMARY"
    [ "$rc" = 0 ] || FAILED=1
}

# 0. Fail fast: nothing else runs without CUDA (unless --tiny), the project's imports and the wheels.
PREFLIGHT='
import importlib.util, sys
tiny, modules = sys.argv[1] == "1", sys.argv[2].split()
missing = [m for m in modules if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"preflight: missing Python packages {missing} (benchmarks/gpu_check.sh --fetch-wheels, carry bench-out/wheels)")
import torch
import patchswarm.daemon.cuda_ipc, patchswarm.daemon.rollout, patchswarm.daemon.publisher, patchswarm.protocol.codec
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())
if not torch.cuda.is_available() and not tiny:
    sys.exit("preflight: torch sees no CUDA device (use --tiny off a GPU machine)")
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), "x", torch.cuda.device_count())
'
if [ "$DRY" = 1 ]; then
    echo "preflight: nvidia-smi -L; $PY -c <imports of: $MODULES; torch.cuda.is_available()>  (exit 2 on failure)"
else
    {
        date -u
        nvidia-smi -L 2>&1 || echo "no nvidia-smi"
    } | tee -a "$SUMMARY"
    if ! timeout 60 "$PY" -c "$PREFLIGHT" "$TINY" "$MODULES" 2>&1 | tee -a "$SUMMARY"; then
        echo "preflight: failed; nothing else run" | tee -a "$SUMMARY"
        exit 2
    fi
fi

KEEP='(cuda or gpu) and not without_cuda' # tests for hosts without CUDA skip on a GPU: not selected
step cuda_quick 110 cuda_quick.log "$PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning -rs \
    -k "$KEEP" --junitxml="$OUT/cuda_quick.xml" tests/system/test_engine_attach.py \
    tests/unit/daemon/test_weightstore.py tests/unit/daemon/test_payloads.py tests/unit/daemon/test_sharded_publish.py \
    tests/unit/protocol/test_context_pass_torch.py
ran_all cuda_quick "$OUT/cuda_quick.xml"

if [ "$TINY" = 1 ]; then
    step codec_digest 120 bench.log "$PY" -m benchmarks.gpu_check --device cpu --gb 0.002 --tensor-mb 1 \
        --fence-gb 0.01 --format2-mb 0 --json "$OUT/codec_digest.json"
    step format2 60 bench.log "$PY" -m benchmarks.gpu_check --device cpu --format2-only --format2-mb 4
else
    step codec_digest 75 bench.log "$PY" -m benchmarks.gpu_check --device cuda:0 --gb 1 --fence-gb 1 \
        --format2-mb 0 --json "$OUT/codec_digest.json"
    step format2 60 bench.log "$PY" -m benchmarks.gpu_check --device cuda:0 --format2-only --format2-mb 1024
fi

step cuda_system 150 cuda_system.log "$PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning -rs \
    -k "$KEEP" --junitxml="$OUT/cuda_system.xml" tests/system/test_daemon_engine_store.py
ran_all cuda_system "$OUT/cuda_system.xml"

if [ "$TINY" = 1 ]; then
    step activation 120 bench.log "$PY" -m benchmarks.activation_bench --device engine-cpu --gpu-gb 0.004 \
        --repeat 1 --json "$OUT/activation.json"
else
    step activation 120 bench.log "$PY" -m benchmarks.activation_bench --device cuda --gpu-gb 14 --frac 0.005 \
        --repeat 2 --journal-dir /tmp/psw-journal --json "$OUT/activation.json"
fi

# 5. Tensor parallel on CUDA rank stores: one real daemon (store.ranks = 2, store.plan = auto, store.kind
# cuda, store.devices = both ranks on cuda:0), a Qwen3-MoE trained by transformers and published fp8 with
# block scales by the CLI; the engine (the test process) allocates and registers each rank's buffer;
# after each version every buffer holds its rank's slice (vLLM's rules, computed in the test) and its
# fence reads the daemon's per-rank root.  Its junit file goes to $TMPDIR, not $OUT (8 files at most).
TP_XML="${TMPDIR:-/tmp}/gpu_check_tp_ranks.xml"
step tp_ranks 90 cuda_system.log "$PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning -rs -k "cuda" \
    --junitxml="$TP_XML" tests/system/test_hf_rank_daemon.py
ran_all tp_ranks "$TP_XML"

if [ "$TINY" = 1 ]; then
    step publish 90 bench.log "$PY" -m benchmarks.publish_bench --params 2e7 --patches 2
else
    step publish 90 bench.log "$PY" -m benchmarks.publish_bench --params 1.07e9 --patches 2 --board /tmp --device cuda
fi
# 7. vLLM and SGLang, where they are installed: real servers (TP=1 and 2, bf16 and fp8) take a version
# through the worker extension / custom loader; pause timed; greedy outputs equal a fresh start on the
# target (benchmarks/engine_check.py).  Neither is on the GPU image today: one "skipped" line each.
step engines 150 bench.log "$PY" -m benchmarks.engine_check
[ "$DRY" = 1 ] && exit 0
echo "total: $SECONDS s of a ${BUDGET} s budget" | tee -a "$SUMMARY"
exit "$FAILED"
