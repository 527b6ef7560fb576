#!/usr/bin/env bash
# Installs llama-cpp-python (the PyPI sdist, built here for the CPU) with its OpenAI-compatible server
# into $CACHE/llama-python-venv: a second engine that embeds llama.cpp, through libllama.so and the
# classic `llama_decode(ctx, llama_batch)` API (llama-server here calls `llama_process`). Cache:
# ${PROBE_CACHE:-~/.cache/probe}; ~10 min the first time on 2 cores, instant after.
# Prints LLAMA_PYTHON=... (the venv's python). Serve the model that scripts/llama.sh unpacks with:
#   $LLAMA_PYTHON -m llama_cpp.server --model $LLAMA_MODEL --host 127.0.0.1 --port 8012
set -euo pipefail

CACHE="${PROBE_CACHE:-$HOME/.cache/probe}"
LLAMA_PYTHON_VERSION="${LLAMA_PYTHON_VERSION:-0.3.36}"
say() { printf 'llama-python: %s\n' "$*" >&2; }
die() { printf 'llama-python: error: %s\n' "$*" >&2; exit 1; }

venv="$CACHE/llama-python-venv"
py="$venv/bin/python"
stamp="$venv/.probe-llama-python-$LLAMA_PYTHON_VERSION"   # written last, so an interrupted install is redone
if [ ! -e "$stamp" ]; then
  say "creating $venv"
  rm -rf "$venv"
  python3 -m venv "$venv" || die "cannot create a virtual environment in $venv"
  "$py" -m pip install -q cmake ninja >&2 || die "cannot install cmake from PyPI"
  say "building llama-cpp-python $LLAMA_PYTHON_VERSION (about 10 minutes on 2 cores)"
  # pip's own client, so the user's configured index, proxy and certificates apply. A portable CPU
  # build: no -march=native (CI machines differ), no tests or examples.
  PATH="$venv/bin:$PATH" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF" \
    "$py" -m pip install -q --no-binary llama-cpp-python "llama-cpp-python[server]==$LLAMA_PYTHON_VERSION" >&2 \
    || die "pip install llama-cpp-python[server]==$LLAMA_PYTHON_VERSION failed (check your pip index, proxy, or the build log above)"
  "$py" -c 'import llama_cpp.server' 2>/dev/null || die "llama_cpp.server does not import in $venv"
  touch "$stamp"
fi
echo "LLAMA_PYTHON=$py"
