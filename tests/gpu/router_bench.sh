#!/usr/bin/env bash
# One replica loaded directly against two replicas behind the SGLang Model Gateway, on one GPU:
#   1. one server with MEMORY_FRACTION of the GPU, loaded directly;
#   2. two servers, each with half of that, behind the router with --policy cache_aware, then
#      behind a fresh router with --policy round_robin (nginx-style);
# each loaded with multi-turn chat (CHATS conversations at a time, TURNS turns, each resending the
# conversation so far) and with a shared prefix (every request starts with the same PREFIX tokens).
# Every run has its own seed, so no run finds another's prompts in a cache. A table last:
# output tok/s, TTFT p50 / p99 and the share of prompt tokens served from the prefix cache, and the
# targets for the chat: cache_aware's share >= 0.9x the single replica's and >= 1.5x round_robin's.
#
#   OUT=results/router bash tests/gpu/router_bench.sh           # about 6 minutes on an H100 (the kernel built once, first)
#   MODEL=random:tiny DEVICE=cpu SECONDS_PER_RUN=10 CHATS=4 OUTPUT=8 OWN=32 PREFIX=128 bash tests/gpu/router_bench.sh
#
# Needs sglang-router (0.3.x) beside the server: on a host without a package index, carry its wheel
# and those of its imports (setproctitle, orjson, aiohttp) in .whl/ or .whl-router/.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-results/router}
MODEL=${MODEL:-random:smollm2-135m}
DEVICE=${DEVICE:-cuda}
MEMORY_FRACTION=${MEMORY_FRACTION:-0.8}
CHATS=${CHATS:-16}
TURNS=${TURNS:-8}
OWN=${OWN:-128}
PREFIX=${PREFIX:-2048}
OUTPUT=${OUTPUT:-128}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-25}
REQUESTS=${REQUESTS:-2048}        # at most this many per run; none started after SECONDS_PER_RUN
WORKERS=${WORKERS:-4}
SERVER_ARGS=${SERVER_ARGS:-}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
wheels=$(ls .whl/*.whl .whl-router/*.whl 2>/dev/null)
if [ -n "$wheels" ] && ! python3 -c "import fastapi, sglang_router.launch_router" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[ -d /tmp/site/bin ] && export PATH=/tmp/site/bin:$PATH      # sglang-router's command, wherever the wheels went in
source tests/gpu/require_server_stack.sh
python3 -c "import sglang_router.launch_router" || { echo "sglang-router or one of its imports is missing (see the header)" >&2; exit 1; }
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT

# serve NAME PORT FRACTION: a replica in the background, its log in $OUT/NAME.log
serve() {
  python3 -m server --host 127.0.0.1 --port "$2" --model "$MODEL" --device "$DEVICE" \
      $( [ "$DEVICE" = cpu ] || echo --gpu-memory-fraction "$3" ) $SERVER_ARGS > "$OUT/$1.log" 2>&1 &
  pids+=($!)
}
wait_healthy() {  # PORT: the replica started last; gives up as soon as it has exited
  local pid=${pids[-1]}
  for _ in $(seq 600); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=2)" 2>/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || { echo "the replica on port $1 exited:" >&2; tail -5 "$OUT"/*.log >&2; return 1; }
    sleep 1
  done
  echo "no replica healthy on port $1" >&2; return 1
}
# load NAME URL SEED: the chat and the shared prefix against URL
load() {
  local name=$1 url=$2 seed=$3
  for kind in chat shared; do
    local extra=(--multi-turn "$TURNS"); [ $kind = shared ] && extra=(--shared-prefix "$PREFIX")
    timeout 300 python3 -m load_tests.loadgen --base-url "$url" --backend openai-chat --concurrency "$CHATS" \
        "${extra[@]}" --input-len "$OWN" --output-len "$OUTPUT" --max-duration "$SECONDS_PER_RUN" \
        --num-prompts "$REQUESTS" --seed "$seed" --warmup 0 --workers "$WORKERS" --no-progress --no-plots \
        --out-dir "$OUT/$name.$kind" > "$OUT/$name.$kind.log" 2>&1 \
      || { echo "loadgen $name.$kind failed:"; tail -5 "$OUT/$name.$kind.log"; }
    stamp "$name.$kind: $(grep -E "c=[0-9]+: " "$OUT/$name.$kind.log" | sed 's/^.*loadgen INFO //')"
  done
}

stamp "one replica, $MEMORY_FRACTION of the GPU"
serve single 18100 "$MEMORY_FRACTION"
wait_healthy 18100 || exit 1
load single http://127.0.0.1:18100 1
cleanup; pids=()

half=$(python3 -c "print($MEMORY_FRACTION / 2)")
stamp "two replicas, $half of the GPU each"
serve replica0 18101 "$half"
wait_healthy 18101 || exit 1
# a fraction is of the whole device, counting what the first replica holds as used
serve replica1 18102 "$MEMORY_FRACTION"
wait_healthy 18102 || exit 1
seed=2
for policy in cache_aware round_robin; do
  python3 -c "
import sys
from pathlib import Path
from load_tests.replicas import Process, router_command, wait_router_ready
urls = ['http://127.0.0.1:18101', 'http://127.0.0.1:18102']
router = Process('router-$policy', router_command(urls, port=18110, policy='$policy', prometheus_port=18111),
                 'http://127.0.0.1:18110', Path('$OUT')).start()
wait_router_ready(router, urls, 60)
print(router.proc.pid)
" > "$OUT/router-$policy.pid" || { echo "the router did not start; $OUT/router-$policy.log:"; tail -5 "$OUT/router-$policy.log"; exit 1; }
  router_pid=$(tail -1 "$OUT/router-$policy.pid")
  load "router_$policy" http://127.0.0.1:18110 $seed
  kill "$router_pid"; seed=$((seed + 1))
  sleep 1
done
cleanup; pids=()
stamp "done"

python3 - "$OUT" "$CHATS" <<'EOF'
import json, sys
from pathlib import Path
out, CHATS = Path(sys.argv[1]), sys.argv[2]
rows = {}
for run in ("single", "router_cache_aware", "router_round_robin"):
    for kind in ("chat", "shared"):
        try:
            (level,) = json.loads((out / f"{run}.{kind}" / "results.json").read_text())["levels"]
            rows[run, kind] = level["summary"]
        except (OSError, ValueError, KeyError):
            rows[run, kind] = None
print(f"\n| run | load | ok / failed | output tok/s | TTFT p50 ms | TTFT p99 ms | prompt tokens cached |")
print("|---|---|---|---|---|---|---|")
for (run, kind), s in rows.items():
    if s is None:
        print(f"| {run} | {kind} | no result | | | | |")
        continue
    share = s.get("cached_prompt_share")
    print(f"| {run} | {kind} | {s['completed']} / {s.get('failed', 0)} | {s['output_throughput']:.0f} | "
          f"{s['ttft_ms'].get('p50', float('nan')):.1f} | {s['ttft_ms'].get('p99', float('nan')):.1f} | "
          f"{'-' if share is None else f'{share:.3f}'} |")
share = {run: (rows[run, "chat"] or {}).get("cached_prompt_share") for run in ("single", "router_cache_aware", "router_round_robin")}
if None in share.values() or not share["single"] or not share["router_round_robin"]:
    print("\nchat targets: not measured", share)
    sys.exit(1)
vs_single = share["router_cache_aware"] / share["single"]
vs_rr = share["router_cache_aware"] / share["router_round_robin"]
print(f"\nmulti-turn chat, {CHATS} conversations at a time: cache_aware / single = {vs_single:.2f} (target >= 0.9: "
      f"{'met' if vs_single >= 0.9 else 'MISSED'}); cache_aware / round_robin = {vs_rr:.2f} "
      f"(target >= 1.5: {'met' if vs_rr >= 1.5 else 'MISSED'})")
EOF
