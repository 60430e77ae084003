#!/usr/bin/env bash
# Sampling features on one GPU host: their GPU tests, the engine benchmark of plain requests
# before and after (tests/gpu/before_after.sh, interleaved), then load_tests.sampling_bench
# (top_logprobs 20 against plain streams, penalties, n = 8 against n = 1). Tables last.
#
#   git archive main | tar -x -C .before          # the code before, beside this checkout
#   BEFORE=.before OUT=$OUT/sampling bash tests/gpu/sampling_bench.sh
#   PARTS="tests bench" ...; PARTS=baseline ...      # in two calls on one warm host (same OUT)
set -uo pipefail
PARTS=${PARTS:-tests baseline bench}
want() { [[ " $PARTS " == *" $1 "* ]]; }
cd "$(dirname "$0")/../.."
OUT=${OUT:-results/sampling}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
source tests/gpu/carried_wheels.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"
if want tests; then
  echo "== GPU tests (bf16 log-probabilities, n, no host sync)"
  timeout 600 python3 -m pytest -q tests/gpu/test_sampling_cuda.py > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"
fi
if want baseline && [ -n "${BEFORE:-}" ]; then
  echo "== plain requests, before and after"
  BEFORE=$BEFORE OUT=$OUT/before_after STAGES="build engine" ROUNDS=${ROUNDS:-2} HF=0 LONG=0 \
    ENGINE_MODELS=${ENGINE_MODELS:-random:smollm2-135m@1,64,256} bash tests/gpu/before_after.sh > "$OUT/before_after.log" 2>&1
fi
if want bench; then
  echo "== sampling benchmark"
  timeout 600 python3 -m load_tests.sampling_bench --device cuda --model random:smollm2-135m --out "$OUT/sampling.json" \
    > "$OUT/sampling.log" 2>&1 || echo "sampling benchmark failed (see sampling.log)"
fi
[ -f "$OUT/before_after/before_after.md" ] && cat "$OUT/before_after/before_after.md"
[ -f "$OUT/sampling.log" ] && { grep -A30 "^NVIDIA" "$OUT/sampling.log" || tail -20 "$OUT/sampling.log"; }
