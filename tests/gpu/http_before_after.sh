#!/usr/bin/env bash
# The HTTP server of two trees on one GPU host, side by side, loaded in turns: random prompts of
# INPUT tokens, OUTPUT tokens out, at each of CONCURRENCY streams, for ROUNDS rounds (before
# first in odd rounds, after first in even ones). Then, per level, the medians over the rounds of
# output tok/s and TTFT p50, each round's after / before ratio, the CPU time the server's
# processes (API workers and core) spent per output token, and how evenly the API workers shared
# the requests (the busiest worker's share; with 4 workers, 25 % is even).
#
#   git archive BASE | tar -x -C .before       # the code before, beside this checkout
#   BEFORE=.before bash tests/gpu/http_before_after.sh OUT_DIR
#   LOADGEN_ARGS="--shared-prefix 2048" BEFORE=.before bash tests/gpu/http_before_after.sh OUT_DIR   # more load generator flags
#   MODEL=random:tiny DEVICE=cpu CONCURRENCY="4" OUTPUT=8 REQUESTS=16 SECONDS_PER_LEVEL=5 BEFORE=.before bash tests/gpu/http_before_after.sh /tmp/h
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: http_before_after.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
BEFORE=$(cd "${BEFORE:?name the tree of the code before}" && pwd)
model=${MODEL:-random:llama-gqa128}
DEVICE=${DEVICE:-cuda}
INPUT=${INPUT:-128}
OUTPUT=${OUTPUT:-256}
CONCURRENCY=${CONCURRENCY:-16 64 256}
REQUESTS=${REQUESTS:-2048}
SECONDS_PER_LEVEL=${SECONDS_PER_LEVEL:-8}
WORKERS=${WORKERS:-8}
ROUNDS=${ROUNDS:-3}
MEMORY_FRACTION=${MEMORY_FRACTION:-0.4}
SERVER_ARGS=${SERVER_ARGS:-}
LOADGEN_ARGS=${LOADGEN_ARGS:-}
source tests/gpu/servers.sh

echo "== $model: the server before and after, taking turns for $ROUNDS rounds"
if start_server before "$out/before" "$BEFORE" "$MEMORY_FRACTION" $SERVER_ARGS \
   && start_server after "$out/after" . "$(python3 -c "print(2 * $MEMORY_FRACTION)")" $SERVER_ARGS; then
  for round in $(seq "$ROUNDS"); do
    order="before after"; [ $((round % 2)) = 0 ] && order="after before"
    for streams in $CONCURRENCY; do
      for tree in $order; do
        dir="$out/$tree"; port_of=port_$tree; port=${!port_of}; pid_of=server_$tree; cpu_pid=${!pid_of}
        loadgen "c$streams.r$round" --concurrency "$streams" --num-prompts "$REQUESTS" --input-len "$INPUT" $LOADGEN_ARGS
      done
    done
  done
fi
kill $server_before $server_after 2>/dev/null; wait $server_before $server_after 2>/dev/null

python3 - "$out" $CONCURRENCY <<'EOF'
import json, statistics, sys
from collections import Counter
from pathlib import Path

out, levels = Path(sys.argv[1]), [int(c) for c in sys.argv[2:]]


def runs(tree, streams):
    """Per round: (output tok/s, TTFT p50 ms, the server's CPU us per output token, the busiest
    API worker's share of the requests)."""
    found = []
    for path in sorted((out / tree).glob(f"c{streams}.r*/results.json"), key=lambda p: int(p.parent.name.rsplit(".r", 1)[1])):
        summary = json.loads(path.read_text())["levels"][0]["summary"]
        log = path.parent.parent / f"{path.parent.name}.requests.jsonl"
        cpu = path.parent.parent / f"{path.parent.name}.cpu_s"
        cpu_us = float(cpu.read_text()) / summary["total_output_tokens"] * 1e6 if cpu.exists() else float("nan")
        ids = [json.loads(line)["engine_request_id"] for line in log.read_text().splitlines() if line.strip()]
        workers = Counter(rid.split(":")[0] if ":" in rid else "0" for rid in ids)   # one worker: no prefix
        busiest = max(workers.values()) / sum(workers.values()) if workers else float("nan")
        found.append((summary["output_throughput"], summary["ttft_ms"]["p50"], cpu_us, busiest))
    return found


def listed(values, fmt):
    return ", ".join(fmt.format(v) for v in values)


rows = ["| streams | tok/s before | tok/s after | after / before (rounds) | TTFT p50 before | TTFT p50 after | "
        "before / after (rounds) | server CPU us/token before | after | after / before (rounds) | "
        "busiest worker's share, before (rounds) | after (rounds) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
for streams in levels:
    before, after = runs("before", streams), runs("after", streams)
    if not before or not after:
        rows.append(f"| {streams} |" + " - |" * 11)
        continue
    median = lambda rounds, i: statistics.median([r[i] for r in rounds])
    speed = [a[0] / b[0] for a, b in zip(after, before)]
    ttft = [b[1] / a[1] for a, b in zip(after, before)]
    cpu = [a[2] / b[2] for a, b in zip(after, before)]
    rows.append(f"| {streams} | {median(before, 0):,.0f} | {median(after, 0):,.0f} | "
                f"{statistics.median(speed):.3f}x ({listed(speed, '{:.3f}')}) | {median(before, 1):.1f} | "
                f"{median(after, 1):.1f} | {statistics.median(ttft):.2f}x ({listed(ttft, '{:.2f}')}) | "
                f"{median(before, 2):.1f} | {median(after, 2):.1f} | {statistics.median(cpu):.3f}x ({listed(cpu, '{:.3f}')}) | "
                f"{listed([b[3] for b in before], '{:.0%}')} | {listed([a[3] for a in after], '{:.0%}')} |")
table = "\n".join(rows)
(out / "summary.md").write_text(table + "\n")
print(table)
EOF
