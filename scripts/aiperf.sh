#!/usr/bin/env bash
# Installs NVIDIA AIPerf (the PyPI package `aiperf`), a load generator for OpenAI-compatible LLM servers,
# into $CACHE/aiperf-venv: `probe bench` can drive it as a second, independent client and read its
# profile_export_aiperf.json. Cache: ${PROBE_CACHE:-~/.cache/probe}; a few minutes the first time, instant after.
# Prints AIPERF=... (the venv's aiperf CLI). Profile a server with, for example:
#   $AIPERF profile --model m --url http://127.0.0.1:8080 --endpoint-type completions --streaming \
#     --tokenizer $CACHE/models/<hf-folder> --concurrency 1 --request-count 4 --artifact-dir out --ui-type none
set -euo pipefail

CACHE="${PROBE_CACHE:-$HOME/.cache/probe}"
AIPERF_VERSION="${AIPERF_VERSION:-0.13.0}"
say() { printf 'aiperf: %s\n' "$*" >&2; }
die() { printf 'aiperf: error: %s\n' "$*" >&2; exit 1; }

venv="$CACHE/aiperf-venv"
py="$venv/bin/python"
stamp="$venv/.probe-aiperf-$AIPERF_VERSION"   # written last, so an interrupted install is redone
if [ ! -e "$stamp" ]; then
  say "creating $venv"
  rm -rf "$venv"
  mkdir -p "$CACHE"
  python3 -m venv "$venv" || die "cannot create a virtual environment in $venv"
  "$py" -m pip install -q --upgrade pip >&2 || die "cannot upgrade pip in $venv"
  say "installing aiperf $AIPERF_VERSION with pip"
  # pip's own client, so the user's configured index, proxy and certificates apply.
  "$py" -m pip install -q "aiperf==$AIPERF_VERSION" >&2 \
    || die "pip install aiperf==$AIPERF_VERSION failed (check your pip index or proxy configuration)"
  [ -x "$venv/bin/aiperf" ] || die "the aiperf package installed no aiperf command in $venv/bin"
  "$py" -c 'import aiperf' 2>/dev/null || die "aiperf does not import in $venv"
  touch "$stamp"
fi
echo "AIPERF=$venv/bin/aiperf"
