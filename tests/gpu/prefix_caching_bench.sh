#!/usr/bin/env bash
# Prefix caching on and off, same host, same run: for each model one server with caching and one
# without, side by side, taking turns level by level for ROUNDS rounds, each loaded with
#   - a shared prefix: every request starts with the same PREFIX tokens, then OWN of its own,
#     OUTPUT tokens out, at concurrency 1 (few requests) and 16, 64;
#   - multi-turn chat: conversations of TURNS turns, each resending the conversation so far;
#   - nothing shared: random prompts of OWN tokens at concurrency 64.
# Then a table: TTFT p50 off / on at 16, output tok/s on / off at 64, the same for the chat and
# for the prompts with nothing shared (medians over the rounds of each round's ratio); and per
# model and caching, each request's legs at 16 streams per API worker and by place in a burst
# (load_tests.request_log, OUT_DIR/<model>_<on|off>_shared16_requests.md).
#
#   bash tests/gpu/prefix_caching_bench.sh OUT_DIR
#   LEVELS="none" ROUNDS=3 bash tests/gpu/prefix_caching_bench.sh OUT_DIR     # nothing shared only
#   OUTPUT_RANGE=0.5 bash tests/gpu/prefix_caching_bench.sh OUT_DIR   # output lengths 128-384: with one
#       length for all, streams that start together stay in step, in waves of varying size
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
ROUNDS=${ROUNDS:-2}
LEVELS=${LEVELS:-shared_c1 shared16 shared64 chat none}   # a subset runs only those levels
MEMORY_FRACTION=${MEMORY_FRACTION:-0.4}   # each of the two servers'
source tests/gpu/servers.sh

# Both servers run side by side (each with a share of the GPU's memory) and take turns level by
# level, round by round (on first in odd rounds, off first in even ones), so that each on / off
# pair is measured minutes apart at most, on the same warm GPU.
for model in $MODELS; do
  echo "== $model: a server with prefix caching and one without, taking turns for $ROUNDS rounds"
  server_on="" server_off=""
  # the second server's share counts the first one's memory as used (gpu_memory_fraction is of
  # the whole device), so it asks for twice the share to get as much again
  if start_server on "$out/${model//[:\/]/_}/on" . "$MEMORY_FRACTION" $SERVER_ARGS \
     && start_server off "$out/${model//[:\/]/_}/off" . "$(python3 -c "print(2 * $MEMORY_FRACTION)")" --no-prefix-caching $SERVER_ARGS; then
    for round in $(seq "$ROUNDS"); do
      order="on off"; [ $((round % 2)) = 0 ] && order="off on"
      for level in $LEVELS; do
        for caching in $order; do
          dir="$out/${model//[:\/]/_}/$caching"; port_of=port_$caching; port=${!port_of}
          case $level in
            shared_c1) loadgen "$level.r$round" --concurrency 1 --num-prompts 8 --shared-prefix "$PREFIX" --input-len "$OWN" ;;
            shared16) loadgen "$level.r$round" --concurrency 16 --num-prompts "$REQUESTS" --shared-prefix "$PREFIX" --input-len "$OWN" ;;
            shared64) loadgen "$level.r$round" --concurrency 64 --num-prompts "$REQUESTS" --shared-prefix "$PREFIX" --input-len "$OWN" ;;
            chat) loadgen "$level.r$round" --concurrency 16 --num-prompts "$REQUESTS" --multi-turn "$TURNS" --input-len "$OWN" ;;
            none) loadgen "$level.r$round" --concurrency 64 --num-prompts "$REQUESTS" --input-len "$OWN" ;;
          esac
        done
      done
    done
  fi
  kill $server_on $server_off 2>/dev/null; wait $server_on $server_off 2>/dev/null
done

python3 - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])


def rounds(folder, name, concurrency):
    """The level's summary in each round, in round order (None where a round has none)."""
    found = []
    runs = [p for p in folder.glob(f"{name}.r*") if p.is_dir()]          # not the .log / .requests.jsonl beside them
    for path in sorted(runs, key=lambda p: int(p.name.rsplit(".r", 1)[1])):
        try:
            doc = json.loads((path / "results.json").read_text())
        except (OSError, ValueError):
            found.append(None)
            continue
        found.append(next((lv["summary"] for lv in doc["levels"] if lv["level"].get("concurrency") == concurrency), None))
    return found


def value(summary, key):
    if summary is None:
        return None
    return summary["ttft_ms"]["p50"] if key == "ttft" else summary[key]


def ratio(model_dir, name, concurrency, key, on_over_off):
    """The median over rounds of each round's on / off (or off / on) ratio, and the rounds' ratios."""
    ratios = []
    for on, off in zip(rounds(model_dir / "on", name, concurrency), rounds(model_dir / "off", name, concurrency)):
        a, b = value(on, key), value(off, key)
        if a and b:
            ratios.append(a / b if on_over_off else b / a)
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)})"


def median_of(model_dir, caching, name, concurrency, key):
    values = [v for v in (value(s, key) for s in rounds(model_dir / caching, name, concurrency)) if v is not None]
    return statistics.median(values) if values else None


rows = ["Medians over the rounds of each round's ratio (each round's in brackets).", "",
        "| model | TTFT p50 at 16, off / on (>= 3x) | tok/s at 64, on / off (>= 1.5x) | multi-turn chat, tok/s on / off | "
        "nothing shared, tok/s on / off (>= 0.98x) | cached share at 16 / 64 / chat / none |", "|---|---:|---:|---:|---:|---:|"]
models = sorted(p for p in out.iterdir() if p.is_dir())
for model_dir in models:
    shares = [median_of(model_dir, "on", name, c, "cached_prompt_share")
              for name, c in (("shared16", 16), ("shared64", 64), ("chat", 16), ("none", 64))]
    rows.append(" | ".join([
        f"| {model_dir.name}", ratio(model_dir, "shared16", 16, "ttft", False),
        ratio(model_dir, "shared64", 64, "output_throughput", True),
        ratio(model_dir, "chat", 16, "output_throughput", True),
        ratio(model_dir, "none", 64, "output_throughput", True),
        " / ".join("-" if v is None else f"{v:.0%}" for v in shares)]) + " |")

rows += ["", "Medians over the rounds: TTFT p50 (ms) and output tok/s per level", "",
         "| model | caching | TTFT p50 at 1 | TTFT p50 at 16 | tok/s at 64 | chat tok/s at 16 | nothing shared, tok/s at 64 |",
         "|---|---|---:|---:|---:|---:|---:|"]
for model_dir in models:
    for caching in ("on", "off"):
        cells = [median_of(model_dir, caching, "shared_c1", 1, "ttft"), median_of(model_dir, caching, "shared16", 16, "ttft"),
                 median_of(model_dir, caching, "shared64", 64, "output_throughput"),
                 median_of(model_dir, caching, "chat", 16, "output_throughput"),
                 median_of(model_dir, caching, "none", 64, "output_throughput")]
        fmt = ["{:.1f}", "{:.1f}", "{:,.0f}", "{:,.0f}", "{:,.0f}"]
        rows.append(f"| {model_dir.name} | {caching} | "
                    + " | ".join("-" if v is None else f.format(v) for f, v in zip(fmt, cells)) + " |")


def server_side(folder, name):
    """Medians of the server's own per-request timings over every round, in ms: the way in (the
    client's send to tokenising), tokenisation, admission to first token, engine queue, engine TTFT,
    delivery."""
    reqs = []
    for path in folder.glob(f"{name}.r*.requests.jsonl"):
        try:
            reqs += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except (OSError, ValueError):
            pass
    if not reqs:
        return None, 0
    return [1e3 * statistics.median(r.get(key) or 0.0 for r in reqs)
            for key in ("request_to_tokenize_s", "tokenize_s", "first_token_s", "queue_s", "ttft_s",
                        "first_token_delivery_s")], len(reqs)


rows += ["", "Where TTFT goes at 1 and 16 streams with the shared prefix (ms; the client's TTFT: the median of the "
         "rounds' p50; the rest: medians over every round's requests, from the server's request log): the way in "
         "(the client's X-Request-Start to tokenising: HTTP, parsing, validation); in the API "
         "worker, tokenisation and admission to the first token; in the engine, the queue and its TTFT (arrival "
         "in the engine to its first token); the first token's trip from the engine to the API worker", "",
         "| model | streams | caching | client TTFT | way in | tokenize | API: admitted to 1st token | engine queue | "
         "engine TTFT | delivery | requests |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
for model_dir in models:
    for name, streams in (("shared_c1", 1), ("shared16", 16)):
        for caching in ("on", "off"):
            ttft = median_of(model_dir, caching, name, streams, "ttft")
            parts, count = server_side(model_dir / caching, name)
            cells = ["-" if ttft is None else f"{ttft:.1f}"] + ([f"{v:.1f}" for v in parts] if parts else ["-"] * 6)
            rows.append(f"| {model_dir.name} | {streams} | {caching} | " + " | ".join(cells) + f" | {count} |")
table = "\n".join(rows)
(out / "summary.md").write_text(table + "\n")
print(table)

# each request's legs at 16 streams, per API worker and by place in a burst (load_tests.request_log)
from load_tests import request_log
for model_dir in models:
    for caching in ("on", "off"):
        timelines = request_log.read(sorted((model_dir / caching).glob("shared16.r*.requests.jsonl")))
        if timelines:
            path = out / f"{model_dir.name}_{caching}_shared16_requests.md"
            path.write_text(f"# {model_dir.name}, caching {caching}, shared prefix at 16 streams, every round\n\n"
                            + request_log.report(timelines) + "\n")
            print(f"\n{path.name}: {request_log.report(timelines).splitlines()[0]}")
EOF
