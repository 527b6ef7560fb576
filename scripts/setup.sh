#!/usr/bin/env bash
# One idempotent setup step: installs what a fresh machine lacks to build probe's eBPF programs.
#  - rust-src for the nightly toolchain (eBPF builds need -Z build-std=core)
#  - bpf-linker 0.13.0 built against nightly's own libLLVM (no system LLVM needed)
#  - cargo-fuzz 0.13.2 (`cargo xtask fuzz`; libFuzzer itself is built by the fuzz crate, with c++)
# Everything lands under ${PROBE_CACHE:-~/.cache/probe}, outside the clone; a second run takes seconds.
set -euo pipefail

CACHE="${PROBE_CACHE:-$HOME/.cache/probe}"
NIGHTLY="${PROBE_NIGHTLY:-nightly}"
BPF_LINKER_VERSION=0.13.0
CARGO_FUZZ_VERSION=0.13.2
mkdir -p "$CACHE/bin"

say() { printf 'setup: %s\n' "$*" >&2; }
# Debian packages need root: directly as root, through sudo for a normal user (the README's
# commands run as the user; sudo asks for the password once).
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
can_install() { command -v apt-get >/dev/null && { [ "$(id -u)" = 0 ] || command -v sudo >/dev/null; }; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

command -v rustup >/dev/null || die "rustup not found: install Rust with rustup first"
rustup toolchain list | grep -q "^$NIGHTLY" || {
  say "installing the $NIGHTLY toolchain"
  rustup toolchain install "$NIGHTLY" --profile minimal || die "cannot install the $NIGHTLY toolchain"
}
sysroot="$(rustc +"$NIGHTLY" --print sysroot)"
if [ ! -d "$sysroot/lib/rustlib/src/rust/library/core" ]; then
  say "adding rust-src to $NIGHTLY"
  rustup component add rust-src --toolchain "$NIGHTLY" || die "cannot add rust-src to $NIGHTLY"
fi

# Test-only system packages: nginx (a real gateway for deadline scenarios), chromium (renders the
# HTML report headless), prometheus (scrapes `probe watch` in its metrics test), golang-go (`go tool
# pprof` reads the pprof exports), iproute2 (network namespaces for the container tests), a C++
# compiler (libFuzzer, for the fuzz targets) and node/npm (the Prometheus operator's models check
# deploy/kubernetes/, scripts/manifests.sh), podman and runc (probe's image and the servers' run
# under a real container runtime, tests/deploy.rs), tmux (a real terminal for the live view's test,
# tests/attach.rs). Debian packages; installed once.
need=()
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || need+=(nginx-light)
command -v chromium >/dev/null || need+=(chromium)
command -v curl >/dev/null || need+=(curl)
command -v prometheus >/dev/null || need+=(prometheus)
[ -x /usr/bin/go ] || need+=(golang-go)
command -v ip >/dev/null || need+=(iproute2)
command -v c++ >/dev/null || need+=(g++)
command -v node >/dev/null || need+=(nodejs)
command -v npm >/dev/null || need+=(npm)
command -v podman >/dev/null || need+=(podman)
command -v tmux >/dev/null || need+=(tmux)
command -v runc >/dev/null || [ -x /usr/sbin/runc ] || need+=(runc)
# `podman kube play` builds its pause image locally around catatonit (nothing is pulled).
command -v catatonit >/dev/null || [ -x /usr/libexec/podman/catatonit ] || need+=(catatonit)
if [ ${#need[@]} -gt 0 ]; then
  if can_install; then
    say "installing ${need[*]} (Debian packages, for the tests)"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >/dev/null \
      || { as_root apt-get update >/dev/null && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need[@]}" >/dev/null; } \
      || die "cannot install ${need[*]} with apt-get"
  else
    say "warning: ${need[*]} missing and not installable here (need apt-get, and root or sudo): the gateway and HTML tests will fail"
  fi
fi

# Bench-only: bpftrace, the reference beside probe in `cargo xtask bench`'s tracing cost, and
# bpftool, which names its BPF programs there. Optional: without them the bench measures probe
# alone (or shows program tags), so a failed install only warns.
bench_need=()
command -v bpftrace >/dev/null || bench_need+=(bpftrace)
command -v bpftool >/dev/null || bench_need+=(bpftool)
if [ ${#bench_need[@]} -gt 0 ]; then
  if can_install; then
    say "installing ${bench_need[*]} (Debian packages, for the bench)"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${bench_need[@]}" >/dev/null \
      || { as_root apt-get update >/dev/null && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${bench_need[@]}" >/dev/null; } \
      || say "warning: cannot install ${bench_need[*]} with apt-get: the bench's tracing cost will measure probe alone"
  else
    say "warning: ${bench_need[*]} missing and not installable here (need apt-get, and root or sudo): the bench's tracing cost will measure probe alone"
  fi
fi

# Test-only Python clients for the client matrix (tests/clients/client.py): the openai SDK, httpx
# and requests, and opentelemetry-proto (decodes OTLP exports in tests/fit.rs), from PyPI through
# pip's configured index, in their own venv.
clients="$CACHE/clients"
want_clients="openai==3.57.0 httpx==0.28.1 requests==2.34.2 opentelemetry-proto==1.45.2"
if [ "$(cat "$clients/.stamp" 2>/dev/null)" != "$want_clients" ]; then
  say "installing the test clients ($want_clients) into $clients"
  python3 -m venv "$clients" || die "cannot create a Python venv in $clients"
  # shellcheck disable=SC2086
  "$clients/bin/pip" install -q $want_clients || die "pip could not install $want_clients"
  echo "$want_clients" > "$clients/.stamp"
fi

# bpf-linker must use the same LLVM as the nightly rustc. Rebuild when nightly changes.
stamp="$CACHE/bpf-linker.stamp"
want="bpf-linker $BPF_LINKER_VERSION / $(rustc +"$NIGHTLY" --version)"
if [ ! -x "$CACHE/bin/bpf-linker" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "building bpf-linker $BPF_LINKER_VERSION against $NIGHTLY's libLLVM (about 2 minutes)"
  llvm_major="$(ls "$sysroot/lib" | sed -n 's/^libLLVM\.so\.\([0-9]*\)\..*/\1/p' | head -n1)"
  [ -n "$llvm_major" ] || die "no libLLVM.so.N in $sysroot/lib: this nightly does not ship its LLVM"
  prefix="$CACHE/llvm"
  mkdir -p "$prefix/lib"
  for f in "$sysroot"/lib/libLLVM*.so*; do ln -sf "$f" "$prefix/lib/"; done
  ln -sf "$(ls "$sysroot"/lib/libLLVM.so."$llvm_major".* | head -n1)" "$prefix/lib/libLLVM.so"
  LLVM_PREFIX="$prefix" cargo install bpf-linker --locked --version "$BPF_LINKER_VERSION" \
      --no-default-features --features "llvm-$llvm_major" --root "$CACHE" --force \
    || die "building bpf-linker failed (see above)"
  echo "$want" > "$stamp"
fi
"$CACHE/bin/bpf-linker" --version >/dev/null 2>&1 || die "$CACHE/bin/bpf-linker does not run"

# cargo-fuzz for the fuzz targets in fuzz/ (run with the nightly toolchain: `cargo +nightly fuzz`),
# in its own root so that nothing else lands on PATH.
fuzz_root="$CACHE/cargo-fuzz"
if [ "$("$fuzz_root/bin/cargo-fuzz" --version 2>/dev/null)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]; then
  say "building cargo-fuzz $CARGO_FUZZ_VERSION (about 2 minutes)"
  cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION" --root "$fuzz_root" --force \
    || die "building cargo-fuzz failed (see above)"
fi
say "ok: nightly $(rustc +"$NIGHTLY" --version | cut -d' ' -f2), $("$CACHE/bin/bpf-linker" --version), $("$fuzz_root/bin/cargo-fuzz" --version)"
