#!/usr/bin/env bash
# Builds probe's .deb (cargo-deb) from a built target/release/probe: the binary (mode 0750, group
# probe and the README's capabilities, set by postinst), man pages, bash/zsh/fish completions and
# the probe-watch systemd unit. cargo-deb is built once into ${PROBE_CACHE:-~/.cache/probe}/cargo-deb.
# Prints the .deb's path. `sudo apt install ./target/debian/probe_*.deb` installs it.
set -euo pipefail

CACHE="${PROBE_CACHE:-$HOME/.cache/probe}"
CARGO_DEB_VERSION="${CARGO_DEB_VERSION:-3.6.2}"
say() { printf 'deb: %s\n' "$*" >&2; }
cd "$(dirname "$0")/.."
[ -x target/release/probe ] || { say "target/release/probe is not built: cargo xtask build first"; exit 1; }
deb_root="$CACHE/cargo-deb"
if [ "$("$deb_root/bin/cargo-deb" --version 2>/dev/null | awk '{print $NF}')" != "$CARGO_DEB_VERSION" ]; then
  say "building cargo-deb $CARGO_DEB_VERSION (about 2 minutes, once)"
  cargo install cargo-deb --locked --version "$CARGO_DEB_VERSION" --root "$deb_root" --force >&2
fi
# The assets probe makes of itself: they match its options.
assets=target/deb-assets
rm -rf "$assets"
mkdir -p "$assets/completions"
target/release/probe man "$assets/man" >/dev/null
target/release/probe completions bash >"$assets/completions/probe"
target/release/probe completions zsh >"$assets/completions/_probe"
target/release/probe completions fish >"$assets/completions/probe.fish"
sed 's|/usr/local/bin/probe|/usr/bin/probe|g; s|/usr/local/share/doc/probe|/usr/share/doc/probe|g' scripts/probe-watch.service >"$assets/probe-watch.service"
mkdir -p target/debian
"$deb_root/bin/cargo-deb" -p probe-user --no-build --no-strip --output target/debian >&2
ls -t target/debian/probe_*.deb | head -n1
