#!/bin/bash
# One GPU job: build, kernel harness, SASS check, sanitizers, pytest -m gpu, ceiling probe, benchmark.
# Logs go to $OUT (default /tmp/jaxbnn_gpu_out): job.log (everything), gpu_results.md, sass.txt.
#   benchmarks/gpu_job.sh [steps...]   steps: build harness check sass sanitize pytest ceiling time trace bench bench-quick ncu ncu-cases
#   (no steps = build check sass sanitize pytest ceiling bench; the kernel harness is built for the steps that run it)
#   COMMIT: the commit the results name; pass it from the session's checkout (the device's copy of the tree
#   keeps a stale git HEAD: jobs L and S-Z2 recorded one). PYTEST_FILES: the test files of the pytest step
#   (default: both GPU files); SANITIZERS: the sanitize step's tools; BENCH_ARGS: gpu_bench.py's options.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jaxbnn_gpu_out}
mkdir -p "$OUT"
LOG="$OUT/job.log"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
BUILD=${BUILD:-/tmp/jaxbnn_build}
mkdir -p "$(dirname "$BUILD")"  # a fresh machine lacks the tree's ignored folders (session 39 lost a job to it)
STEPS=("$@")
JOB_END=$(( $(date +%s) + ${JOB_SECONDS:-560} ))  # the benchmark starts no new layer after this
[ ${#STEPS[@]} -eq 0 ] && STEPS=(build check sass sanitize pytest ceiling bench)
GENCODE=${GENCODE:-"-gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80"}  # the harness's
status=0

log() { echo "=== $* ($(date -u +%H:%M:%S))" | tee -a "$LOG"; }
has() { [[ " ${STEPS[*]} " == *" $1 "* ]]; }

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; nvcc --version | tail -1; } 2>&1 | tee -a "$LOG"

# ../shared does not travel: the ceiling probe needs ceiling.cu and its wgmma_gen.h copied into .carry/ceiling
# (untracked) and carried. Stop before any device time is spent if they are missing (session 40 lost a job to it).
CEIL_SRC=../shared/tools; [ -f .carry/ceiling/ceiling.cu ] && CEIL_SRC=.carry/ceiling
if has ceiling && [ ! -f "$CEIL_SRC/ceiling.cu" ]; then
  echo "ceiling step: no ceiling.cu (mkdir -p .carry/ceiling && cp ../shared/tools/{ceiling.cu,wgmma_gen.h} .carry/ceiling/, carry it)" | tee -a "$LOG"
  exit 2
fi
has bench && ! has ceiling && echo "(bench without the ceiling step: its table says the probe did not run)" | tee -a "$LOG"

if has harness || has check || has sanitize || has time || has ncu || has ncu-cases; then
  log "build: kernel harness"
  nvcc -O2 -std=c++17 $GENCODE -lineinfo -Ixla_ffi xla_ffi/cuda/kernel_check.cu xla_ffi/cuda/binary_gemm.cu \
    -o "$BUILD-kernel_check" 2>&1 | tee -a "$LOG" || status=1
fi
if has build; then
  log "build: jaxbnn._cuda (cmake, target _cuda)"
  cmake -S . -B "$BUILD" -DPython_EXECUTABLE="$(command -v $PY)" -DJAXBNN_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
    >>"$LOG" 2>&1 && cmake --build "$BUILD" --target _cuda -j 16 >>"$LOG" 2>&1 || { echo "cmake build failed" | tee -a "$LOG"; status=1; }
  cp "$BUILD"/xla_ffi/cuda/_cuda*.so jaxbnn/ 2>>"$LOG" && log "installed $(ls jaxbnn/_cuda*.so)"
  # the CPU module too, if it builds, for the cross-check against the CPU handlers
  cmake --build "$BUILD" --target _cpu -j 16 >>"$LOG" 2>&1 && cp "$BUILD"/xla_ffi/cpu/_cpu*.so jaxbnn/ 2>>"$LOG" \
    || echo "(CPU module not built: tests skip the CPU-handler cross-check)" | tee -a "$LOG"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if has check; then
  log "kernel harness: every case, every engine, poisoned outputs vs CPU"
  timeout 300 "$BUILD-kernel_check" 2>&1 | tee "$OUT/kernel_check.log" | grep -v " 0 / " | tee -a "$LOG" || status=1
fi

if has sass; then
  log "SASS of the CUDA module"
  cuobjdump -sass jaxbnn/_cuda*.so > "$OUT/sass_full.txt" 2>&1
  {
    echo "BGMMA AND.POPC: $(grep -c 'BGMMA.*AND\.POPC' "$OUT/sass_full.txt")"
    echo "BMMA AND.POPC: $(grep -c 'BMMA.*AND\.POPC' "$OUT/sass_full.txt")"
    echo "XOR.POPC: $(grep -c 'XOR\.POPC' "$OUT/sass_full.txt")"
    echo "CALL: $(grep -c 'CALL' "$OUT/sass_full.txt") (their targets: sass_calls.py below; an emulation subroutine would show there)"
    echo "local memory (LDL/STL: the epilogues' border-row correction arrays, and the 4-16 bytes that ptxas spills in six wgmma kernels): $(grep -cE '\b(LDL|STL)\b' "$OUT/sass_full.txt")"
    grep -m3 'BGMMA' "$OUT/sass_full.txt"; grep -m3 'BMMA' "$OUT/sass_full.txt"
    $PY benchmarks/sass_calls.py jaxbnn/_cuda*.so
  } 2>&1 | tee "$OUT/sass.txt" | tee -a "$LOG"
  rm -f "$OUT/sass_full.txt"
fi

if has sanitize; then
  for tool in ${SANITIZERS:-memcheck racecheck initcheck}; do
    log "compute-sanitizer --tool $tool (kernel harness --small)"
    timeout 240 compute-sanitizer --tool $tool --error-exitcode 3 "$BUILD-kernel_check" --small 2>&1 \
      | grep -vE " 0 / |^(wgmma|mma_sync|simt) " | tail -15 | tee -a "$LOG" || status=1
  done
fi

if has pytest; then
  log "pytest -m gpu"
  # the wheel maps export/ and train/ into the package (pyproject.toml); the source tree gets links for the same imports
  for sub in export train; do [ -e jaxbnn/$sub ] || ln -s ../$sub jaxbnn/$sub; done
  # the whole log in pytest.log (a crash's first lines name the test), the summary in job.log
  JAXBNN_REQUIRE_GPU=1 timeout 420 $PY -m pytest -q -rfE -m gpu ${PYTEST_FILES:-tests/test_gpu_kernels.py tests/test_gpu_models.py} -p no:cacheprovider \
    > "$OUT/pytest.log" 2>&1 || status=1
  tail -25 "$OUT/pytest.log" | tee -a "$LOG"
fi

if has ceiling; then
  log "ceiling probe (shared/tools/ceiling.cu)"
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a $CEIL_SRC/ceiling.cu -o "$BUILD-ceiling" 2>&1 | tail -3
  timeout 120 "$BUILD-ceiling" 2>&1 | tee "$OUT/ceiling.log" | tee -a "$LOG"
fi

if has time; then
  log "kernel timings (CUDA events, harness)"
  timeout 200 "$BUILD-kernel_check" --time 2>&1 | tee -a "$LOG"
fi

if has trace; then
  # where a tile's time goes in the wgmma kernel (binary_gemm.h, JAXBNN_TILE_TRACE: a diagnostic build of the
  # harness; production builds have no stamps): TRACE_CASES, ';'-separated harness case names
  log "tile trace (harness built with -DJAXBNN_TILE_TRACE)"
  nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -DJAXBNN_TILE_TRACE -Ixla_ffi xla_ffi/cuda/kernel_check.cu \
    xla_ffi/cuda/binary_gemm.cu -o "$BUILD-kernel_trace" 2>&1 | tee -a "$LOG" || status=1
  IFS=';' read -r -a trace_cases <<< "${TRACE_CASES:-bconv C=O=128;bconv C=O=512;bmm 4096^3;bmm 16384^3}"
  for c in "${trace_cases[@]}"; do
    timeout 60 "$BUILD-kernel_trace" --time-wgmma "$c" 2>&1 | tee -a "$OUT/trace.txt" | tee -a "$LOG"
  done
fi

if has ncu; then
  for kernel in ${NCU_KERNELS:-Wgmma MmaSync}; do
    log "ncu of the 16384^3 $kernel bmm"
    mode=--time; skip=33; [ $kernel = Wgmma ] && { mode=--time-wgmma; skip=11; }
    timeout 240 ncu --clock-control none -k regex:$kernel --launch-skip $skip -c 1 --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats \
      --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy --print-details all \
      "$BUILD-kernel_check" $mode \
      > "$OUT/ncu_$kernel.txt" 2>&1
    grep -E "Throughput|Duration|Bank|Stall|Warp Cycles|Issued|Executed Ipc|Registers|L2 Hit|Mem Busy|Max Bandwidth|Shared" \
      "$OUT/ncu_$kernel.txt" | head -60 | tee -a "$LOG"
  done
fi

if has ncu-cases; then
  # one launch of each named harness case (NCU_CASES, ';'-separated) on one engine (NCU_ENGINE: wgmma or
  # mma; NCU_KERNEL: a kernel-name regex instead of the engine's, e.g. DenseTapKernel), full ncu set with
  # source: details in ncu_cases.txt, per-instruction counters and stall samples
  # (`ncu --page source --csv`) of every case in ncu_sources.tar.gz; NCU_FLAGS: more ncu options (e.g.
  # `--cache-control none`: ncu flushes the caches before each profiled launch by default)
  IFS=';' read -r -a cases <<< "${NCU_CASES:-bconv C=O=128;bconv one C=O=512;bconv C=O=512;bmm 4096^3}"
  kernel=Wgmma; mode=--time-wgmma
  [ "${NCU_ENGINE:-wgmma}" = mma ] && { kernel=ClassicKernel; mode=--time-mma; }
  kernel=${NCU_KERNEL:-$kernel}
  sources=$(mktemp -d)
  for c in "${cases[@]}"; do
    log "ncu --set full: $c ($kernel)"
    name=$(echo "$c" | tr -c 'a-zA-Z0-9\n' '_')
    echo "##### $c ($kernel)" >> "$OUT/ncu_cases.txt"
    timeout 120 ncu --clock-control none ${NCU_FLAGS:-} -k regex:$kernel --launch-skip 2 -c 1 --set full --import-source yes \
      -o "$sources/$name" "$BUILD-kernel_check" $mode "$c" > "$sources/$name.log" 2>&1
    ncu -i "$sources/$name.ncu-rep" --page details --print-details all >> "$OUT/ncu_cases.txt" 2>&1
    ncu -i "$sources/$name.ncu-rep" --page source --csv --print-source sass > "$sources/$name.sass.csv" 2>&1
    grep -E "^    (Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Hit|Issue Slots Busy|Executed Ipc A)" \
      "$OUT/ncu_cases.txt" | tail -6 | tee -a "$LOG"
  done
  tar -czf "$OUT/ncu_sources.tar.gz" -C "$sources" $(cd "$sources" && ls *.sass.csv *.log 2>/dev/null)
fi

for mode in bench bench-quick; do
  if has $mode; then
    # the steps before it may have used the job's time (JOB_SECONDS): a negative limit was timeout's error
    if [ $((JOB_END - $(date +%s))) -le 30 ]; then
      log "benchmark ($mode) not run: JOB_SECONDS spent by the steps before it"; status=1; continue
    fi
    log "benchmark ($mode); SM clock, power and temperature every 0.5 s in clocks.csv"
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 500 > "$OUT/clocks.csv" 2>&1 &
    clock_logger=$!
    extra=""; [ $mode = bench-quick ] && extra="--quick"
    timeout $((JOB_END - $(date +%s))) $PY benchmarks/gpu_bench.py $extra ${BENCH_ARGS:-} --ceiling-log "$OUT/ceiling.log" --out "$OUT/gpu_results.md" \
      --commit "${COMMIT:-unknown (COMMIT not set)}" --deadline $((JOB_END - 30)) 2>&1 | tail -80 \
      | tee -a "$LOG" || status=1
    kill $clock_logger 2>/dev/null
  fi
done
log "job status $status"
exit $status
