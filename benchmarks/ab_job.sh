#!/bin/bash
# A/B of kernel versions in one GPU job (METHOD: old and new side by side, same GPU, same process kind).
#   benchmarks/ab_job.sh DIR...        each DIR holds a version's binary_gemm.cu (+ .h, wgmma_b1.cuh),
#                                      e.g. xla_ffi/cuda, or a revision exported with
#                                      mkdir -p .ab/new && git archive REV xla_ffi/cuda | tar -x -C .ab/new --strip-components=2
#                                      (.ab/ is git-ignored: a device job needs it carried)
# Builds the kernel harness (the version's own kernel_check.cu, else the tree's) against each version, runs
# the full harness check on each (a version that fails it goes no further), compute-sanitizer (memcheck,
# racecheck, initcheck; harness --small) on every version but the first, then ROUNDS rounds (default 3; even rounds in reverse order) of each
# harness timing mode in TIME_MODES (default `--time-wgmma`; `--time-mma` times the mma.sync engine) over
# every version (CASES: ';'-separated harness case names; default all). A version's own `time_modes` file
# replaces TIME_MODES for it; a version holding a file `diagnostic` (a timing-only variant whose results are
# wrong by design, e.g. with a stage left out) is neither checked nor sanitized. CHECK_ARGS: the check's
# harness arguments (e.g. `--dense`: the convolutions of fewer than 32 channels only; default every case). TRACE=1 builds every harness
# with the wgmma tile trace (-DJAXBNN_TILE_TRACE: each timed case then prints where a tile's time goes; the
# stamps slow the kernel by ~10%, so compare traced builds only with traced builds). Writes two files to $OUT (default
# /tmp/jaxbnn_ab_out; the device returns at most 8): ab.log, and versions.tar.gz with each version's
# build_N.txt and check_N.log.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jaxbnn_ab_out}
LOGS=$(mktemp -d)  # per-version logs, packed into one file at the end
mkdir -p "$OUT"
LOG="$OUT/ab.log"
GENCODE="-gencode=arch=compute_90a,code=sm_90a"
[ "${TRACE:-0}" = 1 ] && GENCODE="$GENCODE -DJAXBNN_TILE_TRACE"
[ $# -ge 1 ] || { echo "usage: $0 DIR..." >&2; exit 2; }
VERSIONS=("$@")
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv 2>&1 | tee "$LOG"
for i in "${!VERSIONS[@]}"; do
  dir=${VERSIONS[$i]}
  [ -f "$dir/binary_gemm.cu" ] || { echo "$dir: no binary_gemm.cu" | tee -a "$LOG"; exit 2; }
  harness=xla_ffi/cuda/kernel_check.cu; [ -f "$dir/kernel_check.cu" ] && harness="$dir/kernel_check.cu"
  ( nvcc -O2 -std=c++17 $GENCODE -lineinfo -Xptxas=-warn-spills -Ixla_ffi -I"$dir" "$harness" \
      "$dir/binary_gemm.cu" -o "/tmp/ab_kernel_check_$i" > "$LOGS/build_$i.txt" 2>&1 ) &
done
wait
for i in "${!VERSIONS[@]}"; do
  echo "=== version $i: ${VERSIONS[$i]}: $(grep -c spilled "$LOGS/build_$i.txt") spill warnings" | tee -a "$LOG"
  [ -x "/tmp/ab_kernel_check_$i" ] || { tail -5 "$LOGS/build_$i.txt" | tee -a "$LOG"; status=1; continue; }
  if [ -f "${VERSIONS[$i]}/diagnostic" ]; then echo "diagnostic version, not checked: $(cat "${VERSIONS[$i]}/diagnostic")" | tee -a "$LOG"; continue; fi
  timeout ${CHECK_SECONDS:-200} stdbuf -oL "/tmp/ab_kernel_check_$i" ${CHECK_ARGS:-} > "$LOGS/check_$i.log" 2>&1
  echo "check rc=$? ($(date -u +%T))" | tee -a "$LOG"
  grep -v " 0 / " "$LOGS/check_$i.log" | tail -6 | tee -a "$LOG"
  # a version that fails its check (or hangs) is neither sanitized nor timed
  grep -q "ALL OK" "$LOGS/check_$i.log" || { status=1; rm -f "/tmp/ab_kernel_check_$i"; }
done
# every version but the first (the baseline, already checked where it was merged)
for i in "${!VERSIONS[@]}"; do
  { [ "${SANITIZE:-1}" = 1 ] && [ "$i" -gt 0 ] && [ -x "/tmp/ab_kernel_check_$i" ] && [ ! -f "${VERSIONS[$i]}/diagnostic" ]; } || continue
  for tool in memcheck racecheck initcheck; do
    echo "=== compute-sanitizer $tool, version $i ($(date -u +%T))" | tee -a "$LOG"
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 3 "/tmp/ab_kernel_check_$i" --small \
      > "$LOGS/${tool}_$i.log" 2>&1 || status=1
    # the first report (what and where), then the summary
    grep -m 8 -E "^========= +(Invalid|Error|Race|Uninitialized|at |by thread|Address|Program hit)" \
      "$LOGS/${tool}_$i.log" | tee -a "$LOG"
    grep -vE " 0 / |^(wgmma|mma_sync|simt) " "$LOGS/${tool}_$i.log" | tail -4 | tee -a "$LOG"
  done
done
IFS=';' read -r -a cases <<< "${CASES:-}"
[ ${#cases[@]} -eq 0 ] && cases=("")
for round in $(seq 1 "${ROUNDS:-3}"); do
  # odd rounds in the given order, even rounds reversed: a version that always ran first on a GPU found idle
  # (or last on a hot one) would carry that in its numbers
  order=("${!VERSIONS[@]}")
  [ $((round % 2)) -eq 0 ] && order=($(printf '%s\n' "${order[@]}" | sort -rn))
  for i in "${order[@]}"; do
    [ -x "/tmp/ab_kernel_check_$i" ] || continue
    echo "=== time: version $i, round $round ($(date -u +%T))" | tee -a "$LOG"
    modes=${TIME_MODES:---time-wgmma}; [ -f "${VERSIONS[$i]}/time_modes" ] && modes=$(cat "${VERSIONS[$i]}/time_modes")
    for mode in $modes; do
      for c in "${cases[@]}"; do
        args=("$mode"); [ -n "$c" ] && args+=("$c")
        timeout 120 "/tmp/ab_kernel_check_$i" "${args[@]}" 2>&1 | sed "s/^/v$i /" | tee -a "$LOG"
      done
    done
  done
done
tar -czf "$OUT/versions.tar.gz" -C "$LOGS" . && rm -rf "$LOGS"
echo "ab status $status" | tee -a "$LOG"
exit $status
