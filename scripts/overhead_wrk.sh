#!/usr/bin/env bash
# Router overhead measured with wrk (a C load generator, so the client takes little of
# the CPU the router and backend share): the same POST /v1/completions direct to the
# canned backend (kvroute.bench.fake_backend) and through `kvroute serve`, 1 connection
# (latency) and 32 (req/s).
#   apt-get install wrk; scripts/overhead_wrk.sh [policy] [seconds]
set -euo pipefail
cd "$(dirname "$0")/.."
policy=${1:-prefix}; secs=${2:-10}
py=.venv/bin/python
bport=$($py -c 'from kvroute.bench.procs import free_port; print(free_port())')
rport=$($py -c 'from kvroute.bench.procs import free_port; print(free_port())')
$py -m kvroute.bench.fake_backend "$bport" & bpid=$!
$py -m kvroute.cli serve --backend "http://127.0.0.1:$bport" --policy "$policy" --port "$rport" \
    --log-level WARNING & rpid=$!
trap 'kill $bpid $rpid 2>/dev/null || true' EXIT
for u in "http://127.0.0.1:$bport/health" "http://127.0.0.1:$rport/health"; do
  for _ in $(seq 100); do curl -sf "$u" >/dev/null && break; sleep 0.2; done
done
lua=$(mktemp --suffix=.lua)
cat > "$lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"m","prompt":"You are a helpful assistant. Answer briefly: what is prefix caching?","max_tokens":1}'
LUA
run() {  # label url connections
  out=$(wrk -t1 -c"$3" -d"${secs}s" --latency -s "$lua" "$2/v1/completions")
  rps=$(awk '/Requests\/sec/ {print $2}' <<<"$out")
  p50=$(awk '$1=="50%" {print $2}' <<<"$out"); p99=$(awk '$1=="99%" {print $2}' <<<"$out")
  printf '%-8s %3s conn  %10s req/s  p50 %8s  p99 %8s\n' "$1" "$3" "$rps" "$p50" "$p99"
}
echo "policy=$policy, ${secs}s per row, $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg)"
run direct "http://127.0.0.1:$bport" 1
run router "http://127.0.0.1:$rport" 1
run direct "http://127.0.0.1:$bport" 32
run router "http://127.0.0.1:$rport" 32
