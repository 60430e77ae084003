# Two servers side by side, loaded in turns: the helpers the server benchmarks share
# (prefix_caching_bench.sh, http_before_after.sh). Source it from the repository root after
# setting OUTPUT, WORKERS, SECONDS_PER_LEVEL and DEVICE; OUTPUT_RANGE r (default 0) draws each
# request's output length in OUTPUT x [1-r, 1+r]. SERVER_MODULE (default "server") is what runs
# as python -m: "load_tests.synthetic_core --step-ms 4" measures the HTTP layer alone.
#
#   start_server LABEL DIR TREE FRACTION [server flags...]   # a server of TREE's code, its log in DIR;
#                                                            # sets server_LABEL and port_LABEL
#   loadgen NAME [loadgen flags...]                          # one run against $port, into $dir/NAME
#                                                            # (with $cpu_pid set: the CPU seconds that
#                                                            # server's processes spent, into $dir/NAME.cpu_s)

# The servers on one half of the CPUs, the clients on the other: whichever server is loaded gets
# the same cores. Unpinned, two instances of one server differed by 10-15 %, the sign changing
# from run to run (docs/log.md, 2026-12-04). Empty: no pinning.
cpus=$(nproc)
if [ "$cpus" -ge 8 ] && command -v taskset > /dev/null; then
  SERVER_CPUS=${SERVER_CPUS-0-$((cpus / 2 - 1))}
  CLIENT_CPUS=${CLIENT_CPUS-$((cpus / 2))-$((cpus - 1))}
else
  SERVER_CPUS=${SERVER_CPUS-} CLIENT_CPUS=${CLIENT_CPUS-}
fi
source tests/gpu/require_server_stack.sh
# the API workers the server's "auto" gives on the whole host (pinned, it would count half the
# CPUs), unless SERVER_API_WORKERS says how many
api_workers=${SERVER_API_WORKERS:-$(python3 -c "from server.cli import resolve_api_workers; print(resolve_api_workers('auto', '$DEVICE', False))")}
pinned() { local cpus=$1; shift; if [ -n "$cpus" ]; then taskset -c "$cpus" "$@"; else "$@"; fi; }

healthy() { python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null; }
free_port() { python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

loadgen() {
  local name=$1; shift
  local first; first=$(wc -l < "$dir/server.log")
  local cpu_before; [ -n "${cpu_pid:-}" ] && cpu_before=$(python3 -m load_tests.process_cpu "$cpu_pid")
  pinned "$CLIENT_CPUS" timeout 600 python3 -m load_tests.loadgen --base-url "http://127.0.0.1:$port" --output-len "$OUTPUT" \
      --output-range "${OUTPUT_RANGE:-0}" --warmup 2 --no-progress --no-plots --workers "$WORKERS" --max-duration "$SECONDS_PER_LEVEL" \
      --out-dir "$dir/$name" "$@" > "$dir/$name.log" 2>&1 \
    || { echo "loadgen $name failed:"; tail -5 "$dir/$name.log"; }
  [ -n "${cpu_pid:-}" ] && awk -v a="$cpu_before" -v b="$(python3 -m load_tests.process_cpu "$cpu_pid")" \
      'BEGIN { printf "%.2f\n", b - a }' > "$dir/$name.cpu_s"
  # the server's own timings of this run's requests (its request log), the two warm-ups left out
  tail -n +$((first + 1)) "$dir/server.log" | grep '"request finished"' | tail -n +3 > "$dir/$name.requests.jsonl"
  grep -E "c=[0-9]+: " "$dir/$name.log" | sed "s/^.*loadgen INFO /  $name /"
}

start_server() {
  local label=$1 logdir=$2 tree=$3 fraction=$4; shift 4
  mkdir -p "$logdir"
  port=$(free_port)
  local command=(python3 -m ${SERVER_MODULE:-server} --model "$model" --device "$DEVICE" --port "$port" \
                 --gpu-memory-fraction "$fraction" --api-workers "$api_workers" "$@")
  [ -n "$SERVER_CPUS" ] && command=(taskset -c "$SERVER_CPUS" "${command[@]}")
  (cd "$tree" && export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} && exec "${command[@]}") > "$logdir/server.log" 2>&1 &
  server=$!
  eval "server_$label=$server port_$label=$port"
  for _ in $(seq 600); do
    healthy && break
    kill -0 "$server" 2>/dev/null || break
    sleep 0.5
  done
  healthy || { echo "  the $label server did not become healthy:"; tail -20 "$logdir/server.log"; return 1; }
  grep -E "prefix caching|captured prefill|KV pool|HTTP on|not installed" "$logdir/server.log" \
    | sed "s/^/  $label: /" | cut -c1-220
}
