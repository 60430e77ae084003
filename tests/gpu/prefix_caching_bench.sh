#!/usr/bin/env bash
# Prefix caching on and off, same host, same run: for each model one server with caching and one
# without (taking turns), each loaded with
#   - a shared prefix: every request starts with the same PREFIX tokens, then OWN of its own,
#     OUTPUT tokens out, at concurrency 1 (few requests) and 16, 64;
#   - multi-turn chat: conversations of TURNS turns, each resending the conversation so far;
#   - nothing shared: random prompts of OWN tokens at concurrency 64.
# Then a table: TTFT p50 off / on at 16, output tok/s on / off at 64, the same for the chat and
# for the prompts with nothing shared.
#
#   bash tests/gpu/prefix_caching_bench.sh OUT_DIR
#   MODELS=random:tiny DEVICE=cpu PREFIX=64 OWN=8 OUTPUT=4 REQUESTS=8 SECONDS_PER_LEVEL=5 TURNS=2 bash tests/gpu/prefix_caching_bench.sh /tmp/p
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: prefix_caching_bench.sh OUT_DIR}
mkdir -p "$out"
MODELS=${MODELS:-random:smollm2-135m random:llama-gqa128}
DEVICE=${DEVICE:-cuda}
PREFIX=${PREFIX:-2048}
OWN=${OWN:-128}
OUTPUT=${OUTPUT:-256}
REQUESTS=${REQUESTS:-1024}        # at most this many requests per level at 16 and 64 streams, chat and nothing shared,
SECONDS_PER_LEVEL=${SECONDS_PER_LEVEL:-10}  # and none started after this many seconds
TURNS=${TURNS:-8}
WORKERS=${WORKERS:-8}            # client processes: two ran at 190 % of 2 cores at 64 streams and set the pace
SERVER_ARGS=${SERVER_ARGS:-}

healthy() { python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null; }
free_port() { python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

loadgen() {   # loadgen NAME ARGS...: one run against the server on $port, into $dir/NAME
  local name=$1; shift
  local first; first=$(wc -l < "$dir/server.log")
  timeout 600 python3 -m load_tests.loadgen --base-url "http://127.0.0.1:$port" --output-len "$OUTPUT" \
      --warmup 2 --no-progress --no-plots --workers "$WORKERS" --max-duration "$SECONDS_PER_LEVEL" \
      --out-dir "$dir/$name" "$@" > "$dir/$name.log" 2>&1 \
    || { echo "loadgen $name failed:"; tail -5 "$dir/$name.log"; }
  # the server's own timings of this run's requests (its request log), the two warm-ups left out
  tail -n +$((first + 1)) "$dir/server.log" | grep '"request finished"' | tail -n +3 > "$dir/$name.requests.jsonl"
  grep -E "c=[0-9]+: " "$dir/$name.log" | sed "s/^.*loadgen INFO /  $name /"
}

for model in $MODELS; do
  for caching in on off; do
    dir="$out/${model//[:\/]/_}/$caching"
    mkdir -p "$dir"
    port=$(free_port)
    flag=""; [ "$caching" = off ] && flag="--no-prefix-caching"
    echo "== $model, prefix caching $caching"
    python3 -m server --model "$model" --device "$DEVICE" --port "$port" $flag $SERVER_ARGS > "$dir/server.log" 2>&1 &
    server=$!
    for _ in $(seq 600); do
      healthy && break
      kill -0 $server 2>/dev/null || break
      sleep 0.5
    done
    if healthy; then
      grep -E "prefix caching|captured prefill" "$dir/server.log" | sed 's/^/  /' | cut -c1-200
      loadgen shared_c1 --concurrency 1 --num-prompts 8 --shared-prefix "$PREFIX" --input-len "$OWN"
      loadgen shared16 --concurrency 16 --num-prompts "$REQUESTS" --shared-prefix "$PREFIX" --input-len "$OWN"
      loadgen shared64 --concurrency 64 --num-prompts "$REQUESTS" --shared-prefix "$PREFIX" --input-len "$OWN"
      loadgen chat --concurrency 16 --num-prompts "$REQUESTS" --multi-turn "$TURNS" --input-len "$OWN"
      loadgen none --concurrency 64 --num-prompts "$REQUESTS" --input-len "$OWN"
    else
      echo "  the server did not become healthy:"; tail -20 "$dir/server.log"
    fi
    kill $server 2>/dev/null; wait $server 2>/dev/null
  done
done

python3 - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])

def level(path, concurrency):
    try:
        doc = json.loads((path / "results.json").read_text())
    except (OSError, ValueError):
        return None
    return next((lv["summary"] for lv in doc["levels"] if lv["level"].get("concurrency") == concurrency), None)

def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"

rows = ["| model | TTFT p50 at 16, off / on (>= 3x) | tok/s at 64, on / off (>= 1.5x) | multi-turn chat, tok/s on / off | "
        "nothing shared, tok/s on / off (>= 0.98x) | cached share at 16 / 64 / chat / none |", "|---|---:|---:|---:|---:|---:|"]
for model_dir in sorted(p for p in out.iterdir() if p.is_dir()):
    on, off = model_dir / "on", model_dir / "off"
    s16 = [level(d / "shared16", 16) for d in (on, off)]
    s64 = [level(d / "shared64", 64) for d in (on, off)]
    chat = [level(d / "chat", 16) for d in (on, off)]
    none = [level(d / "none", 64) for d in (on, off)]
    get = lambda s, *keys: None if s is None else (s[keys[0]][keys[1]] if len(keys) == 2 else s[keys[0]])
    shares = [get(s, "cached_prompt_share") for s in (s16[0], s64[0], chat[0], none[0])]
    rows.append(" | ".join([
        f"| {model_dir.name}", ratio(get(s16[1], "ttft_ms", "p50"), get(s16[0], "ttft_ms", "p50")),
        ratio(get(s64[0], "output_throughput"), get(s64[1], "output_throughput")),
        ratio(get(chat[0], "output_throughput"), get(chat[1], "output_throughput")),
        ratio(get(none[0], "output_throughput"), get(none[1], "output_throughput")),
        " / ".join("-" if v is None else f"{v:.0%}" for v in shares)]) + " |")


def server_side(path):
    """Medians of the server's own per-request timings, in ms: tokenisation, engine queue, engine TTFT."""
    try:
        reqs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    if not reqs:
        return None
    return [1e3 * statistics.median(r.get(key) or 0.0 for r in reqs)
            for key in ("tokenize_s", "first_token_s", "queue_s", "ttft_s", "first_token_delivery_s")]


rows += ["", "Where TTFT goes at 1 and 16 streams with the shared prefix (medians, ms): the client's TTFT; in the API "
         "worker, tokenisation and admission to the first token; in the engine, the queue and its TTFT (arrival "
         "in the engine to its first token); the first token's trip from the engine to the API worker", "",
         "| model | streams | caching | client TTFT | tokenize | API: admitted to 1st token | engine queue | "
         "engine TTFT | delivery | requests |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
for model_dir in sorted(p for p in out.iterdir() if p.is_dir()):
    for name, streams in (("shared_c1", 1), ("shared16", 16)):
        for caching in ("on", "off"):
            s = level(model_dir / caching / name, streams)
            parts = server_side(model_dir / caching / f"{name}.requests.jsonl")
            cells = [f"{s['ttft_ms']['p50']:.1f}" if s else "-"] + ([f"{v:.1f}" for v in parts] if parts else ["-"] * 5)
            rows.append(f"| {model_dir.name} | {streams} | {caching} | " + " | ".join(cells)
                        + f" | {s['completed'] if s else '-'} |")
table = "\n".join(rows)
(out / "summary.md").write_text(table + "\n")
print(table)
EOF
