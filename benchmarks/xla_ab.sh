#!/bin/bash
# The CUDA module of two source trees through XLA, in one GPU job: builds `jaxbnn._cuda` (and `_cpu`) for
# each tree in parallel, then runs each tree's own copy of a benchmark script against its own module,
# alternating trees over ROUNDS rounds (default 2; even rounds in reverse order).
#   benchmarks/xla_ab.sh BASE_TREE NEW_TREE -- SCRIPT [ARGS...]
# e.g. benchmarks/xla_ab.sh .ab/base . -- benchmarks/dispatch_probe.py conv
# A tree is a checkout of the repository (`mkdir -p .ab/base && git archive REV | tar -x -C .ab/base`; .ab/
# is git-ignored: a device job needs it carried). Logs: $OUT/xla_ab.log (default /tmp/jaxbnn_xla_ab_out).
# STEPS=build builds only (e.g. in the background while another job's builds run), STEPS=run runs the
# modules an earlier `STEPS=build` left in the trees; default both.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jaxbnn_xla_ab_out}
mkdir -p "$OUT"
LOG="$OUT/xla_ab.log"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
[ $# -ge 4 ] && [ "$3" = "--" ] || { echo "usage: $0 BASE_TREE NEW_TREE -- SCRIPT [ARGS...]" >&2; exit 2; }
TREES=("$(realpath "$1")" "$(realpath "$2")")
shift 3
status=0
STEPS=${STEPS:-build run}
for i in 0 1; do
  [[ $STEPS == *build* ]] || break
  tree=${TREES[$i]}
  (
    cmake -S "$tree" -B "/tmp/xla_ab_build_$i" -DPython_EXECUTABLE="$(command -v $PY)" -DJAXBNN_CUDA=ON \
      -DCMAKE_BUILD_TYPE=Release > "$OUT/build_$i.log" 2>&1 &&
      cmake --build "/tmp/xla_ab_build_$i" --target _cuda _cpu -j 8 >> "$OUT/build_$i.log" 2>&1 &&
      cp /tmp/xla_ab_build_$i/xla_ffi/cuda/_cuda*.so /tmp/xla_ab_build_$i/xla_ffi/cpu/_cpu*.so "$tree/jaxbnn/"
  ) &
done
wait
for i in 0 1; do
  ls "${TREES[$i]}"/jaxbnn/_cuda*.so > /dev/null 2>&1 || { echo "tree $i: build failed" | tee -a "$LOG"; tail -20 "$OUT/build_$i.log" | tee -a "$LOG"; status=1; }
done
[ $status -eq 0 ] || exit $status
[[ $STEPS == *run* ]] || exit 0
for round in $(seq 1 "${ROUNDS:-2}"); do
  order=(0 1)
  [ $((round % 2)) -eq 0 ] && order=(1 0)
  for i in "${order[@]}"; do
    tree=${TREES[$i]}
    echo "=== tree $i (${tree}), round $round ($(date -u +%T)): $*" | tee -a "$LOG"
    (cd "$tree/benchmarks" && PYTHONPATH="$tree:$tree/benchmarks" timeout ${RUN_SECONDS:-200} $PY "$(basename "$1")" "${@:2}") 2>&1 \
      | grep -v "^WARNING\|^I0000\|^E0000" | sed "s/^/t$i /" | tee -a "$LOG" || status=1
  done
done
echo "xla_ab status $status" | tee -a "$LOG"
exit $status
