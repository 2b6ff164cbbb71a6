#!/usr/bin/env bash
# Installs a build into a temporary prefix, then builds and runs a consumer project against
# it twice: through find_package(hsap) and through pkg-config.
# Usage: install_test.sh BUILD_DIR CONSUMER_SOURCE_DIR CMAKE C_COMPILER [EXTRA_C_FLAGS]
set -euo pipefail
build_dir=$1 consumer_src=$2 cmake=$3 cc=$4 extra_cflags=${5:-}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/hsap-install-test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

"$cmake" --install "$build_dir" --prefix "$prefix" >"$tmp/install.log"
libdir=$(dirname "$(find "$prefix" -name 'libhsap.so' -print -quit)")
for f in "$prefix/include/hsap/hsap.h" "$libdir/libhsap.so" "$libdir/libhsap.so.0" \
         "$libdir/cmake/hsap/hsapConfig.cmake" "$libdir/cmake/hsap/hsapConfigVersion.cmake" \
         "$libdir/pkgconfig/hsap.pc"; do
  [ -e "$f" ] || { echo "FAIL: $f was not installed"; exit 1; }
done

# 1. CMake package.
"$cmake" -S "$consumer_src" -B "$tmp/consumer-build" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_C_FLAGS="$extra_cflags" \
  -DCMAKE_EXE_LINKER_FLAGS="$extra_cflags" >"$tmp/configure.log" \
  || { cat "$tmp/configure.log"; echo "FAIL: find_package(hsap) configure"; exit 1; }
"$cmake" --build "$tmp/consumer-build" >"$tmp/build.log" \
  || { cat "$tmp/build.log"; echo "FAIL: consumer build"; exit 1; }
"$tmp/consumer-build/hsap_consumer"

# 2. pkg-config, with the .pc file found through PKG_CONFIG_PATH only.
flags=$(PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --cflags --libs hsap)
echo "pkg-config --cflags --libs hsap: $flags"
case "$flags" in *-lhsap*) ;; *) echo "FAIL: no -lhsap in pkg-config output"; exit 1 ;; esac
# shellcheck disable=SC2086
"$cc" -std=c99 $extra_cflags "$consumer_src/main.c" $flags -o "$tmp/pc_consumer"
LD_LIBRARY_PATH="$libdir" "$tmp/pc_consumer"
echo "install test passed"
