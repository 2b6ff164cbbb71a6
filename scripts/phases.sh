# Sourced by scripts/test.sh and .ci/run: `phase NAME CMD...` runs CMD and records how long it
# took; `phase_summary` prints the phases' times (also those of the scripts that ran before
# in the same PHASES_FILE, so that .ci/run's summary holds test.sh's phases too).
PHASES_FILE=${PHASES_FILE:-$(mktemp)}
export PHASES_FILE
phase() {
  local name=$1 start=$SECONDS rc=0
  shift
  echo "=== phase: $name"
  "$@" || rc=$?
  printf '%-20s %5d s%s\n' "$name" $((SECONDS - start)) "$([ $rc -eq 0 ] || echo "  (failed: exit $rc)")" \
    >> "$PHASES_FILE"
  return $rc
}
phase_summary() {
  echo "=== time by phase"
  cat "$PHASES_FILE"
}
