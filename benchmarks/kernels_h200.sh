#!/usr/bin/env bash
# Issue 14 on the H200, in one device call: install, the kernels' GPU tests (in parallel with
# compiling the sweep's candidates), then the tile sweep and the attention suite with its winners.
# Run from the repository root: COMMIT=<sha> bash benchmarks/kernels_h200.sh
# (DECODE_SWEEP=1: issue 29's decode sweep and the decode/fp8 GPU tests instead, see below)
# Writes to $OUT: gpu_tests.log, kernels.log, kernels.json, gpu.txt; prints a short table last.
set -u
OUT=${OUT:-/tmp/kernels-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation . >"$OUT/install.log" 2>&1 \
    || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu \
    --format=csv >"$OUT/gpu.txt" 2>&1
XDIST=""
python3 -c "import xdist" 2>/dev/null && XDIST="-n 8"
if [ "${DECODE_SWEEP:-0}" = 1 ]; then
    # Issue 29 instead: the decode sweep (at most ~150 s), then the decode and fp8 GPU tests.
    # Writes decode_sweep.log, decode_sweep.json, gpu_tests.log; prints the sweep's table last.
    python3 benchmarks/kernels_bench.py --decode-sweep --jobs "${JOBS:-14}" \
        --json "$OUT/decode_sweep.json" --commit "${COMMIT:-unknown}" >"$OUT/decode_sweep.log" 2>&1
    echo "kernels_bench exit status $?" >>"$OUT/decode_sweep.log"
    timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu tests/plugins/kernels/test_fused_gpu.py \
        -k "fp8 or decode" $XDIST -p no:cacheprovider >"$OUT/gpu_tests.log" 2>&1
    echo "pytest exit status $?" >>"$OUT/gpu_tests.log"
    echo "== GPU tests"; tail -n 15 "$OUT/gpu_tests.log"
    echo "== decode sweep"; grep -E "^(compiled|stage|--sweep|sweep took)" "$OUT/decode_sweep.log"
    sed -n '/^decode sweep/,$p' "$OUT/decode_sweep.log"
    exit 0
fi
(
    timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu tests/plugins/kernels/test_fused_gpu.py \
        -k "not dummy" $XDIST -p no:cacheprovider >"$OUT/gpu_tests.log" 2>&1
    echo "pytest exit status $?" >>"$OUT/gpu_tests.log"
) &
TESTS=$!
timeout "${WARM_TIMEOUT:-150}" python3 benchmarks/kernels_bench.py --tune --warm-only --jobs 7 \
    >"$OUT/warm.log" 2>&1
wait $TESTS
python3 benchmarks/kernels_bench.py --tune --use-winners --peer --json "$OUT/kernels.json" \
    --commit "${COMMIT:-unknown}" >"$OUT/kernels.log" 2>&1
echo "kernels_bench exit status $?" >>"$OUT/kernels.log"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader \
    >>"$OUT/gpu.txt" 2>&1
echo "== GPU tests"; tail -n 15 "$OUT/gpu_tests.log"
echo "== sweep winners and suite"; sed -n '/^winners:/,$p' "$OUT/kernels.log"
