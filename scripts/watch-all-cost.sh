#!/usr/bin/env bash
# What `probe watch --all` costs on this node with 0, 1, 4 and 16 llama-servers (SERVERS="0 1 4 16";
# four of them asked one small completion a second, round robin, so the load is the same however
# many servers there are): % of one core = CPU of every probe process (the agent, and the followers
# of a release that started one per server,
# from /proc/PID/stat) plus the run time of every BPF program (kernel.bpf_stats_enabled), per
# wall second, over SECS seconds after every follower armed. Run as root after `cargo xtask
# build`; LLAMA_SERVER and LLAMA_MODEL as `cargo xtask test` sets them (scripts/llama.sh prints them).
set -euo pipefail
cd "$(dirname "$0")/.."
SECS="${SECS:-20}"
PROBE="${PROBE_BIN:-target/release/probe}"
: "${LLAMA_SERVER:?set LLAMA_SERVER (scripts/llama.sh prints it)}" "${LLAMA_MODEL:?set LLAMA_MODEL}"
tick=$(getconf CLK_TCK)
work=$(mktemp -d /tmp/probe-watch-all-cost.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
prev_stats=$(sysctl -n kernel.bpf_stats_enabled)
sysctl -qw kernel.bpf_stats_enabled=1
trap 'sysctl -qw kernel.bpf_stats_enabled='"$prev_stats"'; cleanup' EXIT

# CPU ticks of the agent and its followers.
probe_ticks() {
  local total=0 p
  for p in $(pgrep -f "^$PROBE watch" || true); do
    total=$((total + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)))
  done
  echo "$total"
}
# One HTTP request to a llama-server this script started on loopback: ask PORT PATH [JSON BODY]
# (POST when a body is given); fails unless it answers 200.
ask() {
  python3 - "$@" <<'PY'
import http.client, sys
port, path, body = int(sys.argv[1]), sys.argv[2], (sys.argv[3] if len(sys.argv) > 3 else None)
try:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST" if body else "GET", path, body, {"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    sys.exit(0 if r.status == 200 else 1)
except OSError:
    sys.exit(1)
PY
}
# Resident memory of the agent and its followers, MiB.
probe_rss() {
  local total=0 p
  for p in $(pgrep -f "^$PROBE watch" || true); do
    total=$((total + $(awk '/^VmRSS:/ {print $2}' "/proc/$p/status" 2>/dev/null || echo 0)))
  done
  echo $((total / 1024))
}
bpf_ns() { bpftool prog show -j 2>/dev/null | python3 -c 'import json,sys; print(sum(p.get("run_time_ns",0) for p in json.load(sys.stdin)))'; }

printf 'watch --all cost (%% of one core: probe processes + BPF run time, per wall second, %s s):\n' "$SECS"
base=""
for n in ${SERVERS:-0 1 4 16}; do
  ports=()
  for i in $(seq 1 "$n"); do
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    "$LLAMA_SERVER" -m "$LLAMA_MODEL" -c 512 -np 1 -t 1 --host 127.0.0.1 --port "$port" >/dev/null 2>&1 &
    pids+=($!); ports+=("$port")
  done
  for port in "${ports[@]}"; do until ask "$port" /health; do sleep 0.2; done; done
  "$PROBE" watch --all --dir "$work/state-$n" --scan-every 2s 2>"$work/log-$n" &
  agent=$!
  until [ "$(grep -c 'armed in' "$work/log-$n" || true)" -ge "$n" ] && grep -q 'looking for LLM servers' "$work/log-$n"; do sleep 0.2; done
  sleep 3
  t0=$(probe_ticks); b0=$(bpf_ns); s0=$(date +%s.%N)
  end=$(( $(date +%s) + SECS ))
  asks=()
  k=0
  while [ "$(date +%s)" -lt "$end" ]; do
    for j in $(seq 0 $(( (n < 4 ? n : 4) - 1 ))); do
      [ "$n" -gt 0 ] || break
      port=${ports[$(( (k * 4 + j) % n ))]}
      ask "$port" /completion '{"prompt":"Hi","n_predict":4}' & asks+=($!)
    done
    k=$((k + 1))
    sleep 1
  done
  for a in "${asks[@]}"; do wait "$a" || true; done
  t1=$(probe_ticks); b1=$(bpf_ns); s1=$(date +%s.%N); rss=$(probe_rss)
  pct=$(python3 -c "w=$s1-$s0; print(f'{100*(($t1-$t0)/$tick + ($b1-$b0)/1e9)/w:.2f}')")
  proc_pct=$(python3 -c "w=$s1-$s0; print(f'{100*(($t1-$t0)/$tick)/w:.2f}')")
  bpf_pct=$(python3 -c "w=$s1-$s0; print(f'{100*(($b1-$b0)/1e9)/w:.2f}')")
  per=""
  if [ "$n" -gt 0 ]; then per=$(python3 -c "print(f', {($pct - ${base:-0})/$n:.2f}% and {($rss - ${base_rss:-0})/$n:.0f} MiB per server')"); fi
  printf '  %d server(s): %s%% (processes %s%%, BPF %s%%); memory %s MiB%s\n' "$n" "$pct" "$proc_pct" "$bpf_pct" "$rss" "$per"
  [ "$n" -eq 0 ] && base=$pct && base_rss=$rss
  kill -TERM "$agent"; wait "$agent" || true
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  pids=()
  sleep 1
done
