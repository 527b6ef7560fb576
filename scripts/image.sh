#!/usr/bin/env bash
# An OCI image of one dynamically linked program, built where no base image can be pulled:
# `FROM scratch` with the program and exactly the libraries `ldd` lists, at the paths the loader
# looks for them (libraries outside the system directories are put on LD_LIBRARY_PATH).
#
#   scripts/image.sh TAG PROGRAM [PATH_IN_IMAGE]
#
# Builds with podman, else docker (ENGINE=podman|docker chooses). Prints `IMAGE=TAG` on stdout.
# `cargo xtask image` builds probe's image with it; the container tests build a llama-server image
# the same way. The build context is a private temporary folder, removed on exit.
set -euo pipefail

say() { printf 'image: %s\n' "$*" >&2; }
die() { printf 'image: error: %s\n' "$*" >&2; exit 1; }

[ $# -ge 2 ] || die "usage: scripts/image.sh TAG PROGRAM [PATH_IN_IMAGE]"
tag="$1"
prog="$(readlink -f -- "$2")"
dest="${3:-/usr/bin/$(basename -- "$prog")}"
[ -f "$prog" ] && [ -x "$prog" ] || die "$2 is not an executable file"
case "$dest" in /*) ;; *) die "PATH_IN_IMAGE must be absolute: $dest" ;; esac

engine="${ENGINE:-}"
if [ -z "$engine" ]; then
  if command -v podman >/dev/null; then engine=podman
  elif command -v docker >/dev/null; then engine=docker
  else die "neither podman nor docker is installed (sudo apt-get install podman)"; fi
fi
command -v "$engine" >/dev/null || die "$engine is not installed"
command -v ldd >/dev/null || die "ldd is not installed (libc-bin)"

umask 077
ctx="$(mktemp -d "${TMPDIR:-/tmp}/probe-image.XXXXXX")"
trap 'rm -rf -- "$ctx"' EXIT
mkdir -p "$ctx/rootfs$(dirname -- "$dest")" "$ctx/rootfs/tmp"
cp -- "$prog" "$ctx/rootfs$dest"
chmod 0755 "$ctx/rootfs$dest"
chmod 1777 "$ctx/rootfs/tmp"

# `ldd` names every library the loader maps (and the loader itself); copy each, links followed,
# to its own path.
libs=()
while read -r lib; do
  [ -n "$lib" ] && libs+=("$lib")
done < <(ldd "$prog" 2>/dev/null | sed -n 's/.*=> \(\/[^ ]*\) .*/\1/p; s/^[[:space:]]*\(\/[^ ]*\) (0x.*/\1/p' | sort -u)
if [ ${#libs[@]} -eq 0 ]; then
  ldd "$prog" >/dev/null 2>&1 && die "ldd lists no libraries for $prog"
  say "$prog is statically linked: the image holds it alone"
fi
extra=()
for lib in "${libs[@]}"; do
  mkdir -p "$ctx/rootfs$(dirname -- "$lib")"
  cp -L -- "$lib" "$ctx/rootfs$lib"
  case "$(dirname -- "$lib")" in
    /lib | /lib64 | /usr/lib | /usr/lib64 | /lib/x86_64-linux-gnu | /usr/lib/x86_64-linux-gnu | /lib/aarch64-linux-gnu | /usr/lib/aarch64-linux-gnu) ;;
    *) extra+=("$(dirname -- "$lib")") ;;
  esac
done
# The loader's own path may be a link in the host's /lib64 (to /lib/x86_64-linux-gnu/...): ldd
# names the link, and `cp -L` made it a file, which is what the program's PT_INTERP asks for.

{
  echo "FROM scratch"
  echo "COPY rootfs/ /"
  if [ ${#extra[@]} -gt 0 ]; then
    echo "ENV LD_LIBRARY_PATH=$(printf '%s\n' "${extra[@]}" | sort -u | paste -sd:)"
  fi
  echo "ENTRYPOINT [\"$dest\"]"
} >"$ctx/Containerfile"

say "building $tag with $engine: $dest and ${#libs[@]} libraries"
"$engine" build -q -t "$tag" -f "$ctx/Containerfile" "$ctx" >/dev/null || die "$engine build failed"
echo "IMAGE=$tag"
