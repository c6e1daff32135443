#!/usr/bin/env bash
# GPU checks of the engine-allocated CUDA weight store, in one run of under 8 minutes on one GPU:
#   1. the CUDA tests (engine process allocates on the GPU and registers its CUDA IPC handle with a
#      real daemon; kill -9 mid-activation; bad registrations; the CUDA IPC export/import; the state
#      root computed on the GPU)                                            -> cuda_tests.log/.xml
#   2. the activation pause on a 14 GB bf16 model with 0.5% changed (goal <= 50 ms), the state root
#      on the GPU against blake3 on a host copy                             -> activation.log/.json
#   3. the codec's torch path on the GPU (encode == host encode, apply bitwise, both against the
#      device's memcpy) and the device digest against blake3               -> codec_digest.log/.json
#   4. publish latency of a 1.07B-parameter model: on the machine's CPUs (the 3x-memcpy goal on a
#      trainer-class host), then with the FP32 masters on the GPU             -> publish.log
# The CUDA tests include the publisher's (GPU masters publish the CPU board byte for byte; fp8).
# Results go to $OUT (default bench-out/gpu); summary.txt has the environment and each step's exit status.
#
#   benchmarks/gpu_check.sh                 on the GPU machine
#   benchmarks/gpu_check.sh --tiny          anywhere: tiny sizes, the GPU-only parts skip without CUDA
#   benchmarks/gpu_check.sh --fetch-wheels  here (pip reaches the index): the Python packages the GPU
#                                           image lacks, as py3.12 x86-64 wheels, into bench-out/wheels
# On the GPU machine the wheels in bench-out/wheels (carried there) are installed into /tmp/site.
set -u -o pipefail
cd "$(dirname "$0")/.."
WHEELS=bench-out/wheels
# What the GPU image (torch, numpy, aiohttp, msgpack, pytest, hypothesis, yaml, prometheus-client...)
# lacks of the project's and the tests' dependencies; versions as in this checkout's .venv.
NEED="blake3 zstandard cryptography cffi pycparser pytest-asyncio jsonschema jsonschema-specifications referencing rpds-py"

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
[ "${1:-}" = "--tiny" ] && TINY=1
OUT=${OUT:-bench-out/gpu}
mkdir -p "$OUT"
if ls "$WHEELS"/*.whl >/dev/null 2>&1 && [ ! -x .venv/bin/python ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site || echo "wheel install failed"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
SUMMARY="$OUT/summary.txt"  # environment, then one line per step ($OUT keeps to 7 files)

step() {  # step NAME TIMEOUT_S CMD...: run with a limit, log to $OUT/NAME.log, record the status
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - t0)) s" | tee -a "$SUMMARY"
    tail -n 25 "$OUT/$name.log"
}

{
    date -u
    nvidia-smi -L 2>&1 || echo "no nvidia-smi"
    "$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())'
} 2>&1 | tee "$SUMMARY"

step cuda_tests 150 "$PY" -m pytest -v -p no:cacheprovider -W ignore::DeprecationWarning -k "cuda or gpu" \
    tests/system/test_daemon_engine_store.py tests/system/test_engine_attach.py tests/unit/daemon/test_weightstore.py \
    tests/unit/daemon/test_payloads.py tests/unit/daemon/test_sharded_publish.py -rs

if [ "$TINY" = 1 ]; then
    step activation 120 "$PY" -m benchmarks.activation_bench --device engine-cpu --gpu-gb 0.004 --repeat 1 \
        --json "$OUT/activation.json"
    step codec_digest 120 "$PY" -m benchmarks.gpu_check --device cpu --gb 0.002 --tensor-mb 1 \
        --json "$OUT/codec_digest.json"
    step publish 120 "$PY" -m benchmarks.publish_bench --params 2e7 --patches 2
else
    step activation 170 "$PY" -m benchmarks.activation_bench --device cuda --gpu-gb 14 --frac 0.005 --repeat 3 \
        --journal-dir /tmp/psw-journal --json "$OUT/activation.json"
    step codec_digest 70 "$PY" -m benchmarks.gpu_check --device cuda:0 --gb 2 --json "$OUT/codec_digest.json"
    # one log for both publish runs (what comes back from the machine is at most 8 files)
    step publish 150 bash -c "'$PY' -m benchmarks.publish_bench --params 1.07e9 --patches 3 --board /tmp \
        && '$PY' -m benchmarks.publish_bench --params 1.07e9 --patches 3 --board /tmp --device cuda"
fi
cat "$SUMMARY"
! grep -E "^[a-z_]+: exit [0-9]+ in" "$SUMMARY" | grep -qv ": exit 0 in"
