#!/usr/bin/env bash
# Installs a built probe the way the README's Security section describes, or removes it:
#   scripts/install.sh [--prefix DIR] [--group NAME] [--uninstall] [BINARY]
# BINARY (default target/release/probe) goes to DIR/bin/probe (default DIR /usr/local), mode
# 0750, group NAME (default probe, created as a system group when missing), with the capabilities
# probe needs (setcap, when the filesystem keeps them). Its man pages go to DIR/share/man/man1,
# its bash, zsh and fish completions under DIR/share. Run as root (`cargo xtask install` asks for
# sudo once). --uninstall removes exactly those files; the group stays (other files may use it).
set -euo pipefail

prefix=/usr/local
group=probe
uninstall=0
bin=target/release/probe
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix="$2"; shift 2 ;;
    --group) group="$2"; shift 2 ;;
    --uninstall) uninstall=1; shift ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    -*) echo "install: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) bin="$1"; shift ;;
  esac
done
say() { printf 'install: %s\n' "$*" >&2; }
[ "$(id -u)" = 0 ] || { say "run it as root (cargo xtask install asks for sudo)"; exit 1; }
case "$prefix" in /*) ;; *) say "--prefix must be an absolute path: $prefix"; exit 2 ;; esac

man1="$prefix/share/man/man1"
bash_c="$prefix/share/bash-completion/completions/probe"
zsh_c="$prefix/share/zsh/site-functions/_probe"
fish_c="$prefix/share/fish/vendor_completions.d/probe.fish"
# What an install writes, the only paths an uninstall removes.
pages=(probe probe-trace probe-watch probe-report probe-flamegraph probe-timeline probe-export probe-bundle probe-diff probe-doctor
       probe-completions probe-man probe-bench)

if [ "$uninstall" = 1 ]; then
  rm -f -- "$prefix/bin/probe" "$bash_c" "$zsh_c" "$fish_c"
  for p in "${pages[@]}"; do rm -f -- "$man1/$p.1"; done
  say "removed probe from $prefix (the group $group stays)"
  exit 0
fi

[ -x "$bin" ] || { say "$bin is not a built probe: run cargo build --release first"; exit 1; }
getent group "$group" >/dev/null || groupadd --system "$group"
install -d -m 0755 "$prefix/bin" "$man1" "$(dirname "$bash_c")" "$(dirname "$zsh_c")" "$(dirname "$fish_c")"
install -m 0750 -o root -g "$group" "$bin" "$prefix/bin/probe"
caps=cap_bpf,cap_perfmon,cap_dac_read_search,cap_sys_ptrace,cap_syslog,cap_checkpoint_restore+ep
if command -v setcap >/dev/null && setcap "$caps" "$prefix/bin/probe" 2>/dev/null; then
  say "$prefix/bin/probe: mode 0750, group $group, capabilities $caps (members of $group can trace without sudo)"
else
  say "$prefix/bin/probe: mode 0750, group $group; no capabilities set (setcap missing or the filesystem keeps none): run it with sudo"
fi
# Man pages and completions from the installed binary itself (they match its options).
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$prefix/bin/probe" man "$work/man" >/dev/null
for f in "$work"/man/*.1; do install -m 0644 "$f" "$man1/"; done
"$prefix/bin/probe" completions bash >"$work/bash" && install -m 0644 "$work/bash" "$bash_c"
"$prefix/bin/probe" completions zsh >"$work/zsh" && install -m 0644 "$work/zsh" "$zsh_c"
"$prefix/bin/probe" completions fish >"$work/fish" && install -m 0644 "$work/fish" "$fish_c"
say "man pages in $man1, completions for bash, zsh and fish under $prefix/share"
