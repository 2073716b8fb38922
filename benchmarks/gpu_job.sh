#!/bin/bash
# One GPU job: build, kernel harness, SASS check, sanitizers, pytest -m gpu, ceiling probe, benchmark.
# Logs go to $OUT (default /tmp/jaxbnn_gpu_out): job.log (everything), gpu_results.md, sass.txt.
#   benchmarks/gpu_job.sh [steps...]   steps: build check sass sanitize pytest ceiling time bench bench-quick ncu ncu-cases
#   (no steps = build check sass sanitize pytest ceiling bench)
#   COMMIT: the commit the results name; pass it from your checkout (the device's copy of the tree may keep a
#   stale git HEAD). PYTEST_FILES: the test files of the pytest step (default: both GPU files); SANITIZERS: the
#   sanitize step's tools (ctest tests kernel_check_<tool>); BENCH_ARGS: gpu_bench.py's options.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jaxbnn_gpu_out}
mkdir -p "$OUT"
LOG="$OUT/job.log"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
BUILD=${BUILD:-/tmp/jaxbnn_build}
mkdir -p "$(dirname "$BUILD")"
STEPS=("$@")
JOB_END=$(( $(date +%s) + ${JOB_SECONDS:-560} ))  # the benchmark starts no new layer after this
[ ${#STEPS[@]} -eq 0 ] && STEPS=(build check sass sanitize pytest ceiling bench)
status=0

log() { echo "=== $* ($(date -u +%H:%M:%S))" | tee -a "$LOG"; }
has() { [[ " ${STEPS[*]} " == *" $1 "* ]]; }

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; nvcc --version | tail -1; } 2>&1 | tee -a "$LOG"
has bench && ! has ceiling && echo "(bench without the ceiling step: its table says the probe did not run)" | tee -a "$LOG"

# One CMake build holds the CUDA module, the CPU module and the kernel harness (JAXBNN_KERNEL_TESTS: the
# ctest targets kernel_check and kernel_check_<sanitizer>), all from the same kernel library.
if has build || has check || has sanitize || has time || has ncu || has ncu-cases; then
  log "build: cmake (targets _cuda, _cpu, kernel_check)"
  cmake -S . -B "$BUILD" -DPython_EXECUTABLE="$(command -v $PY)" -DJAXBNN_CUDA=ON -DJAXBNN_KERNEL_TESTS=ON \
    -DCMAKE_BUILD_TYPE=Release >>"$LOG" 2>&1 && cmake --build "$BUILD" --target _cuda kernel_check -j 16 >>"$LOG" 2>&1 \
    || { echo "cmake build failed" | tee -a "$LOG"; status=1; }
  cp "$BUILD"/xla_ffi/cuda/_cuda*.so jaxbnn/ 2>>"$LOG" && log "installed $(ls jaxbnn/_cuda*.so)"
  # the CPU module too, if it builds, for the cross-check against the CPU handlers
  cmake --build "$BUILD" --target _cpu -j 16 >>"$LOG" 2>&1 && cp "$BUILD"/xla_ffi/cpu/_cpu*.so jaxbnn/ 2>>"$LOG" \
    || echo "(CPU module not built: tests skip the CPU-handler cross-check)" | tee -a "$LOG"
fi
HARNESS="$BUILD/xla_ffi/cuda/kernel_check"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if has check; then
  log "kernel harness (ctest -L check): every case, every engine, poisoned outputs vs CPU"
  ctest --test-dir "$BUILD" -L check -V 2>&1 | tee "$OUT/kernel_check.log" | grep -vE " 0 / |^[0-9]+: (wgmma|mma_sync|simt) " \
    | tail -20 | tee -a "$LOG"
  grep -q "100% tests passed" "$OUT/kernel_check.log" || status=1
fi

if has sass; then
  log "SASS of the CUDA module"
  cuobjdump -sass jaxbnn/_cuda*.so > "$OUT/sass_full.txt" 2>&1
  {
    echo "BGMMA AND.POPC: $(grep -c 'BGMMA.*AND\.POPC' "$OUT/sass_full.txt")"
    echo "BMMA AND.POPC: $(grep -c 'BMMA.*AND\.POPC' "$OUT/sass_full.txt")"
    echo "XOR.POPC: $(grep -c 'XOR\.POPC' "$OUT/sass_full.txt")"
    echo "CALL: $(grep -c 'CALL' "$OUT/sass_full.txt") (their targets: sass_calls.py below; an emulation subroutine would show there)"
    echo "local memory (LDL/STL: the epilogues' border-row correction arrays, and what ptxas spills (benchmarks/ptxas_report.py lists it per kernel)): $(grep -cE '\b(LDL|STL)\b' "$OUT/sass_full.txt")"
    grep -m3 'BGMMA' "$OUT/sass_full.txt"; grep -m3 'BMMA' "$OUT/sass_full.txt"
    $PY benchmarks/sass_calls.py jaxbnn/_cuda*.so
  } 2>&1 | tee "$OUT/sass.txt" | tee -a "$LOG"
  # every kernel's .text digest, to compare builds (benchmarks/cubin_text.py --against)
  $PY benchmarks/cubin_text.py jaxbnn/_cuda*.so > "$OUT/cubin_text.txt" 2>&1
  rm -f "$OUT/sass_full.txt"
fi

if has sanitize; then
  # ctest's kernel_check_<tool>: compute-sanitizer --tool <tool> --error-exitcode 3 on the harness's --small set
  tests=$(for tool in ${SANITIZERS:-memcheck racecheck initcheck synccheck}; do printf 'kernel_check_%s|' "$tool"; done)
  log "compute-sanitizer (ctest: ${tests%|})"
  ctest --test-dir "$BUILD" -R "^(${tests%|})$" -j 2 -V > "$OUT/sanitize.log" 2>&1 || status=1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Test +#|tests passed|tests failed" "$OUT/sanitize.log" | tee -a "$LOG"
fi

if has pytest; then
  log "pytest -m gpu"
  # the wheel maps export/ and train/ into the package (pyproject.toml); the source tree gets links for the same imports
  for sub in export train; do [ -e jaxbnn/$sub ] || ln -s ../$sub jaxbnn/$sub; done
  # the whole log in pytest.log (a crash's first lines name the test), the summary in job.log. With
  # pytest-xdist, PYTEST_WORKERS processes share the GPU (each allocating as it needs): most of the suite's
  # time is the host compiling models, and one process took over 420 s for both files (6 workers: 315 s; on
  # an H100 host with 15 workers 402 s once, over 420 another time: hence 540 s, within a device call's 600).
  workers=()
  $PY -c "import xdist" 2>/dev/null && workers=(-n "${PYTEST_WORKERS:-6}")
  XLA_PYTHON_CLIENT_PREALLOCATE=false JAXBNN_REQUIRE_GPU=1 timeout 540 $PY -m pytest -q -rfE -m gpu "${workers[@]}" \
    ${PYTEST_FILES:-tests/test_gpu_kernels.py tests/test_gpu_models.py} -p no:cacheprovider > "$OUT/pytest.log" 2>&1 || status=1
  tail -25 "$OUT/pytest.log" | tee -a "$LOG"
fi

if has ceiling; then
  log "ceiling probe (benchmarks/ceiling/ceiling.cu)"
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a benchmarks/ceiling/ceiling.cu -o "$BUILD-ceiling" 2>&1 | tail -3
  timeout 120 "$BUILD-ceiling" 2>&1 | tee "$OUT/ceiling.log" | tee -a "$LOG"
fi

if has time; then
  log "kernel timings (CUDA events, harness)"
  timeout 200 "$HARNESS" --time 2>&1 | tee -a "$LOG"
fi


if has ncu; then
  for kernel in ${NCU_KERNELS:-Wgmma MmaSync}; do
    log "ncu of the 16384^3 $kernel bmm"
    mode=--time; skip=33; [ $kernel = Wgmma ] && { mode=--time-wgmma; skip=11; }
    timeout 240 ncu --clock-control none -k regex:$kernel --launch-skip $skip -c 1 --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats \
      --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy --print-details all \
      "$HARNESS" $mode \
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
      -o "$sources/$name" "$HARNESS" $mode "$c" > "$sources/$name.log" 2>&1
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
