#!/usr/bin/env bash
# The kernel and engine benchmarks of two trees on one GPU host, taking turns, and their ratios.
#
#   git archive BASE | tar -x -C .before       # the code before, beside this checkout
#   BEFORE=.before OUT=results/before_after bash tests/gpu/before_after.sh
#   STAGES="build kernel" ... ; STAGES=engine ...     # in parts, on one warm host (same OUT)
#
# Both trees' kernels are built first (each in a cache of its own); then the kernel benchmark
# runs once per tree and the engine benchmark ROUNDS times per tree, alternating, so that drift
# of the host hits both alike. compare_before_after.py prints the ratios last.
set -uo pipefail
cd "$(dirname "$0")/../.."
BEFORE=$(cd "${BEFORE:?name the tree of the code before}" && pwd)
AFTER=$PWD
OUT=${OUT:-results/before_after}
ROUNDS=${ROUNDS:-2}
STAGES=${STAGES:-build kernel engine}
want() { [[ " $STAGES " == *" $1 "* ]]; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
source tests/gpu/carried_wheels.sh
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
in_tree() {  # in_tree before|after command...
  local name=$1; shift
  local dir=$AFTER; [ "$name" = before ] && dir=$BEFORE
  (cd "$dir" && FLASHDECODE_CACHE=/tmp/flashdecode-$name PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} "$@")
}

if want build; then
  stamp "building both kernels"
  in_tree before python3 -c "from kernels import ops; ops.load()" > "$OUT/build_before.log" 2>&1 &
  in_tree after python3 -c "from kernels import ops; ops.load()" > "$OUT/build_after.log" 2>&1 &
  wait
  tail -3 "$OUT"/build_*.log
fi
want kernel && for name in before after; do
  stamp "kernel benchmark, $name"
  # the kernel benchmark moved from kernels/bench.py to benchmarks/kernel_bench.py
  bench=benchmarks.kernel_bench; [ "$name" = before ] && [ ! -f "$BEFORE/benchmarks/kernel_bench.py" ] && bench=kernels.bench
  in_tree $name timeout 300 python3 -m $bench --out "$OUT/kernel_$name" --repeat 3 \
      > "$OUT/kernel_$name.log" 2>&1 || echo "kernel benchmark of $name failed (see kernel_$name.log)"
done
# ENGINE_MODELS: model@batches entries, each run by both trees in every round (the --hf column
# and the long-context rows with the first only; HF=0, LONG=0 for none)
ENGINE_MODELS=${ENGINE_MODELS:-random:smollm2-135m@1,16,64,256}
want engine && for round in $(seq "$ROUNDS"); do
  first=1
  for entry in $ENGINE_MODELS; do
    model=${entry%@*} batches=${entry#*@} tag=${model//[:\/.]/_}
    hf=""; [ "$first" = 1 ] && [ "${HF:-1}" = 1 ] && hf="--hf"
    long=""; [ "$first" = 1 ] && [ "${LONG:-1}" = 1 ] && long="--long-batch 1 8"
    first=0
    for name in before after; do
      stamp "engine benchmark, $model, $name, round $round"
      in_tree $name timeout 300 python3 -m load_tests.engine_bench --device cuda --model "$model" \
          --batch ${batches//,/ } $long $hf --repeats 3 --out "$OUT/engine_${tag}_${name}_$round.json" \
          > "$OUT/engine_${tag}_${name}_$round.log" 2>&1 || echo "engine benchmark of $name failed (see engine_${tag}_${name}_$round.log)"
    done
  done
done
stamp "done"
python3 "$AFTER/tests/gpu/compare_before_after.py" "$OUT" | tee "$OUT/before_after.md"
