#!/usr/bin/env bash
# Group signals on the GPU, and the CPU path's responsiveness on 2 pinned cores of the GPU host
# (quieter than the development machine). Logs and JSON under $OUT; a short table last.
#   OUT=/tmp/out bash tests/gpu/reliability.sh [path of a checkout of the code before, for a baseline]
set -u
OUT=${OUT:-/tmp/reliability}
mkdir -p "$OUT"
PY=${PY:-python3}
BEFORE=${1:-}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
source tests/gpu/carried_wheels.sh
$PY -m pytest -q -rs -m gpu tests/test_http_shutdown.py -k "cuda" > "$OUT/shutdown_cuda.log" 2>&1
echo "group-signal tests on CUDA: $(tail -1 "$OUT/shutdown_cuda.log")" > "$OUT/summary.txt"
taskset -c 0,1 $PY -m load_tests.cpu_responsiveness --busy 2 --prompt-tokens 4000 \
    --out "$OUT/cpu_responsiveness_after.json" > "$OUT/cpu_responsiveness_after.log" 2>&1
if [ -n "$BEFORE" ]; then
    cp load_tests/cpu_responsiveness.py "$BEFORE/load_tests/"
    (cd "$BEFORE" && taskset -c 0,1 $PY -m load_tests.cpu_responsiveness --busy 2 --prompt-tokens 4000 \
        --stream-tokens 30 --out "$OUT/cpu_responsiveness_before.json") > "$OUT/cpu_responsiveness_before.log" 2>&1
fi
for f in "$OUT"/cpu_responsiveness_*.log; do
    echo "== $(basename "$f" .log) (2 cores pinned)" >> "$OUT/summary.txt"
    tail -6 "$f" >> "$OUT/summary.txt"
done
cat "$OUT/summary.txt"
