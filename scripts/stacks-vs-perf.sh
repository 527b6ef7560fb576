#!/usr/bin/env bash
# Stack depth beside perf's, in one run: a llama-server (LLAMA_SERVER, LLAMA_MODEL, as
# scripts/llama.sh prints them) generating while `probe trace` and
# `perf record --call-graph dwarf,65528` sample it at once. Prints, for each, the CPU samples
# with user frames, their median user depth, and the share that reach the server's entry
# function (`llama_server`). perf's inlined frames are left out: probe names functions, not what was
# inlined into them. Run as root: PROBE=target/release/probe scripts/stacks-vs-perf.sh
set -euo pipefail

PROBE="${PROBE:-target/release/probe}"
: "${LLAMA_SERVER:?set LLAMA_SERVER (scripts/llama.sh prints it)}" "${LLAMA_MODEL:?set LLAMA_MODEL}"
command -v perf >/dev/null || { echo "stacks-vs-perf: perf is not installed (linux-perf)" >&2; exit 1; }
work="$(mktemp -d)"
server=""
cleanup() { [ -n "$server" ] && kill "$server" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
"$LLAMA_SERVER" -m "$LLAMA_MODEL" -c 2048 -np 1 -t 2 --host 127.0.0.1 --port "$port" >/dev/null 2>&1 &
server=$!
for _ in $(seq 100); do curl -sf "127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
body='{"messages":[{"role":"user","content":"Tell me a long story about a cat and a dog, with many turns."}],"max_tokens":64,"cache_prompt":false,"stream":true}'
ask() { curl -s -o /dev/null "127.0.0.1:$port/v1/chat/completions" -d "$body"; }
ask
"$PROBE" trace --pid "$server" --out "$work/rec" --duration 6 >"$work/trace.log" 2>&1 &
tracer=$!
perf record -F 99 --call-graph dwarf,65528 -p "$server" -o "$work/perf.data" -- sleep 6 >/dev/null 2>&1 &
perfer=$!
sleep 1
for _ in 1 2 3; do ask; done
wait "$tracer" "$perfer"
perf script -i "$work/perf.data" 2>/dev/null >"$work/perf.txt"
python3 - "$work" <<'PY'
import statistics, sys
work = sys.argv[1]
def say(tool, depths, under):
    n = len(depths)
    print(f"{tool}: {n} CPU samples with user frames, median user depth {statistics.median(depths) if n else 0}, "
          f"reaching llama_server {100 * under / max(n, 1):.0f}%")
depths, under = [], 0
for s in open(f"{work}/perf.txt").read().strip().split("\n\n"):
    frames = [l for l in s.split("\n")[1:] if l.strip() and "kernel.kallsyms" not in l and "[unknown]" not in l and "(inlined)" not in l]
    if frames:
        depths.append(len(frames))
        under += any("llama_server" in l for l in frames)
say("perf ", depths, under)
depths, under = [], 0
for line in open(f"{work}/rec/flame-cpu.folded"):
    stack, count = line.rstrip().rsplit(" ", 1)
    # The first frame is the command; kernel frames end in _[k].
    frames = [f for f in stack.split(";")[1:] if not f.endswith("_[k]")]
    depths += [len(frames)] * int(count)
    under += int(count) * ("llama_server" in stack)
say("probe", depths, under)
PY
