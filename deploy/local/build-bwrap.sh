#!/usr/bin/env bash
# Builds trainyard-bwrap: Debian's bubblewrap (the sources and patches of the package deploy/lock/debian.txt
# names, so the same program as /usr/bin/bwrap) linked statically with musl, with Debian's libcap the same way.
#
# Why: the agent starts a bwrap for every node of every job. A glibc program's start-up probes the CPU (cpuid, a
# trap to the hypervisor on a virtual machine, dozens of times) and Debian's bwrap loads four shared libraries
# besides; built with musl and linked statically, a sandbox's start costs about half a millisecond of CPU less
# (docs/benchmarks.md). It is linked with bwrap-arena.c, an allocator that hands memory out in order and never
# gives it back, which spares the mmap and munmap calls musl's made for bwrap's short set-up (about 0.2 ms of CPU
# a start more). Where this cannot be built (no musl-gcc, no kernel headers, the sources cannot be
# fetched), nothing is installed and agents run the system's bwrap.
#
# usage: build-bwrap.sh OUTPUT
# Each source is fetched from Debian's archive (DEBIAN_MIRROR) into a cache (TRAINYARD_SOURCE_CACHE) and used
# only when its SHA-256 is the one below, as each package's .dsc lists it.
set -euo pipefail
OUTPUT="$1"
HERE="$(cd "$(dirname "$0")" && pwd)"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
CACHE="${TRAINYARD_SOURCE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/trainyard/sources}"

# path in the archive's pool, SHA-256 (bubblewrap 0.8.0-2+deb12u1, libcap2 1:2.66-4+deb12u2)
SOURCES=(
  "pool/main/b/bubblewrap/bubblewrap_0.8.0.orig.tar.xz 957ad1149db9033db88e988b12bcebe349a445e1efc8a9b59ad2939a113d333a"
  "pool/main/b/bubblewrap/bubblewrap_0.8.0-2+deb12u1.debian.tar.xz 37917e8abdd6df1d1118f089e9cf1f9374e1b5bb21c8a70d7de4e9b5dfb10f6d"
  "pool/main/libc/libcap2/libcap2_2.66.orig.tar.xz 15c40ededb3003d70a283fe587a36b7d19c8b3b554e33f86129c059a4bb466b2"
  "pool/main/libc/libcap2/libcap2_2.66-4+deb12u2.debian.tar.xz b60f0b25112d6ec9fcbd410b05dd56ba93db636969bda57362e57113fc338984"
)

command -v musl-gcc >/dev/null || { echo "musl-gcc is not installed (Debian package musl-tools)" >&2; exit 1; }
[ -f /usr/include/linux/capability.h ] || { echo "no kernel headers (Debian package linux-libc-dev)" >&2; exit 1; }

# fetch POOL-PATH SHA256: the file's path in the cache, once its digest is the expected one.
fetch() {
  local file="$CACHE/$(basename "$1")"
  if ! echo "$2  $file" | sha256sum --check --status 2>/dev/null; then
    mkdir -p "$CACHE"
    curl --fail --silent --show-error --location --retry 3 --max-time 120 \
      -o "$file.part" "$MIRROR/${1//+/%2B}"
    echo "$2  $file.part" | sha256sum --check --status || { echo "$1: not the expected SHA-256" >&2; exit 1; }
    mv "$file.part" "$file"
  fi
  echo "$file"
}

# unpack ORIG DEBIAN DIR: the upstream sources with Debian's patches applied, in their order.
unpack() {
  mkdir -p "$3"
  tar -xf "$1" -C "$3" --strip-components=1
  tar -xf "$2" -C "$3"
  local patch
  while read -r patch; do
    case "$patch" in ''|'#'*) continue ;; esac
    patch --quiet --directory="$3" -p1 < "$3/debian/patches/$patch"
  done < "$3/debian/patches/series"
}

files=()
for source in "${SOURCES[@]}"; do
  files+=("$(fetch $source)")
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
unpack "${files[0]}" "${files[1]}" "$work/bubblewrap"
unpack "${files[2]}" "${files[3]}" "$work/libcap"

# musl's compiler sees no headers but its own: the kernel's, which both include, are shown to it alone.
mkdir -p "$work/kernel"
ln -s /usr/include/linux /usr/include/asm-generic "$work/kernel/"
ln -s "/usr/include/$(gcc -print-multiarch)/asm" "$work/kernel/asm"

make --silent -C "$work/libcap/libcap" CC=musl-gcc BUILD_CC=gcc SHARED=no libcap.a >/dev/null
printf '#define PACKAGE_STRING "bubblewrap 0.8.0"\n' > "$work/bubblewrap/config.h"
(cd "$work/bubblewrap" && musl-gcc -O2 -static -D_GNU_SOURCE -include config.h \
   -I"$work/libcap/libcap/include/uapi" -I"$work/libcap/libcap/include" -I"$work/kernel" \
   -o "$work/trainyard-bwrap" bubblewrap.c bind-mount.c network.c utils.c "$HERE/bwrap-arena.c" \
   "$work/libcap/libcap/libcap.a")
"$work/trainyard-bwrap" --version >/dev/null
install -m 0755 "$work/trainyard-bwrap" "$OUTPUT"
