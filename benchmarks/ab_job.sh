#!/bin/bash
# A/B of kernel versions in one GPU job: old and new side by side, same GPU, same process kind.
#   benchmarks/ab_job.sh DIR...        each DIR is a version's CUDA sources folder, named `cuda` (the include
#                                      root is its parent): xla_ffi/cuda, or a revision exported with
#                                      mkdir -p .ab/new && git archive REV xla_ffi/cuda | tar -x -C .ab/new --strip-components=1
#                                      (then DIR is .ab/new/cuda; .ab/ is git-ignored: a device job needs it carried)
# Builds each version's kernel harness (DIR/tests/kernel_check.cu with DIR/kernels/*.cu and DIR/host/*.cu), runs
# the full harness check on each (a version that fails it goes no further), compute-sanitizer (memcheck,
# racecheck, initcheck; harness --small) on every version but the first, then ROUNDS rounds (default 3; even
# rounds in reverse order) of each harness timing mode in TIME_MODES (default `--time-wgmma`; `--time-mma`
# times the mma.sync engine) over every version (CASES: ';'-separated harness case names; default all). A
# version's own `time_modes` file replaces TIME_MODES for it; a version holding a file `diagnostic` (a
# timing-only variant whose results are wrong by design, e.g. with a stage left out) is neither checked nor
# sanitized. CHECK_ARGS: the check's harness arguments (e.g. `--dense`: the convolutions of fewer than 32
# channels only; default every case). Writes two files to $OUT (default /tmp/jaxbnn_ab_out): ab.log, and
# versions.tar.gz with each version's build_N.txt and check_N.log.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jaxbnn_ab_out}
LOGS=$(mktemp -d)  # per-version logs, packed into one file at the end
mkdir -p "$OUT"
LOG="$OUT/ab.log"
GENCODE="-gencode=arch=compute_90a,code=sm_90a"
[ $# -ge 1 ] || { echo "usage: $0 DIR..." >&2; exit 2; }
VERSIONS=("$@")
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv 2>&1 | tee "$LOG"
for i in "${!VERSIONS[@]}"; do
  dir=${VERSIONS[$i]}
  { [ "$(basename "$dir")" = cuda ] && [ -f "$dir/tests/kernel_check.cu" ]; } \
    || { echo "$dir: not a CUDA sources folder named cuda with tests/kernel_check.cu" | tee -a "$LOG"; exit 2; }
  # every source in parallel, then one link: the kernel families compile in a fraction of one nvcc call's time
  ( objs=()
    for f in "$dir/tests/kernel_check.cu" "$dir"/kernels/*.cu "$dir"/host/*.cu; do
      obj="$LOGS/obj_${i}_$(basename "$f" .cu).o"; objs+=("$obj")
      nvcc -c -O2 -std=c++17 $GENCODE -lineinfo -Xptxas=-warn-spills -I"$(dirname "$dir")" "$f" -o "$obj" &
    done
    wait
    nvcc $GENCODE "${objs[@]}" -o "/tmp/ab_kernel_check_$i" ) > "$LOGS/build_$i.txt" 2>&1 &
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
