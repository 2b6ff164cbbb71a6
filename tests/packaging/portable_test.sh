#!/usr/bin/env bash
# libhsap.so runs on any x86-64 CPU, not only on the machine that built it:
#  1. no compile command of the library (build/compile_commands.json) asks for the build
#     machine's ISA (-march=native) or another CPU's (-march=haswell) or for an extension
#     (-mavx*, -mfma, ...);
#  2. every function of libhsap.so that uses an instruction beyond the x86-64 baseline
#     (anything VEX/EVEX-encoded, ymm/zmm/mask registers, SSE3/SSSE3/SSE4, BMI, LZCNT,
#     POPCNT, MOVBE) is a copy of the hand-written kernels chosen at run time: its name lies
#     in the namespace isa_avx2 or isa_avx512 (attention/kernel_isa.inc);
#  3. and such copies exist (a check that finds nothing to check fails).
# Usage: portable_test.sh COMPILE_COMMANDS_JSON LIBHSAP_SO [OBJDUMP]
# Exits 77 (skipped) off x86-64.
set -euo pipefail
commands=$1 lib=$2 objdump=${3:-objdump}

if [ "$(uname -m)" != x86_64 ]; then
  echo "SKIP: the instruction check is written for x86-64"
  exit 77
fi

# 1. Compile commands: one "command" line per translation unit in CMake's output.
lib_commands=$(grep '"command"' "$commands" | grep 'hsap_objects\.dir' || true)
[ -n "$lib_commands" ] || { echo "FAIL: no library compile command in $commands"; exit 1; }
isa_flags=$(grep -o -E -- '-m(arch|tune|cpu)=[^ "]+|-m(avx[0-9a-z]*|fma|bmi2?|f16c|sse[3-4][.0-9a-z]*|ssse3|popcnt|lzcnt)\b' \
  <<< "$lib_commands" | grep -v -x -E -- '-m(arch|tune)=(x86-64|generic)' | sort | uniq -c || true)
if [ -n "$isa_flags" ]; then
  echo "FAIL: the library is compiled for a particular CPU:"
  printf '%s\n' "$isa_flags"
  exit 1
fi

# 2. and 3. Instructions: per function, the count of instructions beyond the baseline.
beyond=$("$objdump" -d --no-show-raw-insn -C "$lib" | awk '
  /^[0-9a-f]+ <.*>:$/ {
    fn = substr($0, index($0, "<") + 1)
    sub(/>:$/, "", fn)
    next
  }
  /^ *[0-9a-f]+:\t/ {
    insn = substr($0, index($0, "\t") + 1)
    sub(/ *#.*/, "", insn)   # the disassembler comment names symbols
    sub(/ *<.*/, "", insn)   # so does a call or jump target
    mnemonic = insn
    sub(/ .*/, "", mnemonic)
    if (insn ~ /%[yz]mm[0-9]|%k[0-7]/ ||
        (mnemonic ~ /^v/ && insn ~ /%xmm/) ||
        mnemonic ~ /^(andn|bextr|blsi|blsmsk|blsr|bzhi|mulx|pdep|pext|rorx|sarx|shlx|shrx)$/ ||
        mnemonic ~ /^(lzcnt|popcnt|movbe|crc32[bwlq]?)$/ ||  # not tzcnt: it decodes GCC rep bsf
        mnemonic ~ /^(pshufb|palignr|phadd|phsub|pmaddubsw|pmulhrsw|psign|pabs)/ ||
        mnemonic ~ /^(ptest|pblend|blendv?p[sd]|round[ps][sd]|pm(in|ax)(sb|sd|uw|ud))/ ||
        mnemonic ~ /^(pmulld|pmuldq|insertps|extractps|pextr[bdq]|pinsr[bdq]|pmov[sz]x)/ ||
        mnemonic ~ /^(dpp[sd]|pcmp(eq|gt)q|pcmp[ei]str|packusdw|movntdqa|mpsadbw|phminposuw)/ ||
        mnemonic ~ /^(lddqu|hadd|hsub|movs[hl]dup|movddup|addsub)/) {
      count[fn]++
    }
  }
  END { for (f in count) printf "%d\t%s\n", count[f], f }')

dispatched='::isa_avx(2|512)::'
bad=$(grep -v -E "$dispatched" <<< "$beyond" || true)
if [ -n "$bad" ]; then
  echo "FAIL: $(wc -l <<< "$bad") functions outside the run-time dispatched kernel copies use"
  echo "instructions beyond the x86-64 baseline (count, function; the first 20):"
  sort -rn <<< "$bad" | head -20 || true  # head closes the pipe early: not a failure
  exit 1
fi
avx2=$(grep -c '::isa_avx2::' <<< "$beyond" || true)
avx512=$(grep -c '::isa_avx512::' <<< "$beyond" || true)
if [ "$avx2" -eq 0 ] || [ "$avx512" -eq 0 ]; then
  echo "FAIL: expected AVX2 and AVX-512 copies of the hand-written kernels; found $avx2 AVX2 and"
  echo "$avx512 AVX-512 functions using those instruction sets"
  exit 1
fi
echo "portable test passed: no -march/-m<isa> flag in the library's compile commands; beyond the"
echo "x86-64 baseline only in the dispatched copies ($avx2 AVX2 and $avx512 AVX-512 functions)"
