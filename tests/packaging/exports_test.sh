#!/usr/bin/env bash
# libhsap.so exports only the C ABI (hsap* symbols and the HSAP_0 version node) and has the
# SONAME libhsap.so.<major>.
# Usage: exports_test.sh LIBHSAP_SO EXPECTED_SONAME
set -euo pipefail
lib=$1 want_soname=$2
symbols=$(nm -D --defined-only "$lib" | awk '{print $NF}' | sed 's/@.*//')
bad=$(printf '%s\n' "$symbols" | grep -v -E '^(hsap[A-Za-z0-9_]*|HSAP_[0-9]+)$' || true)
if [ -n "$bad" ]; then
  echo "FAIL: libhsap.so exports symbols outside the C ABI:"
  printf '%s\n' "$bad" | head -20
  exit 1
fi
count=$(printf '%s\n' "$symbols" | grep -c '^hsap' || true)
for sym in hsapGetVersion hsapGetErrorString hsapGetLastError hsapLayoutCreate \
           hsapAttentionForwardLocal hsapAttentionBackwardLocal; do
  # A here-string, not a pipe: grep -q exits at the first match, and under pipefail the
  # writer's SIGPIPE would fail the check.
  grep -qx "$sym" <<< "$symbols" || { echo "FAIL: $sym is not exported"; exit 1; }
done
soname=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\].*/\1/p')
[ "$soname" = "$want_soname" ] || { echo "FAIL: SONAME is '$soname', expected $want_soname"; exit 1; }
echo "exports test passed: $count hsap* symbols, SONAME $soname"
