#!/usr/bin/env bash
# gpu_proof.sh - the whole CUDA path proved in one run on a GPU machine, results in one folder.
#
# Usage:
#   bash benchmarks/gpu_proof.sh [--out DIR] [--build-dir DIR] [--deadline S]   on the GPU machine
#   bash benchmarks/gpu_proof.sh --dry-run [--build-dir DIR]                       anywhere (CI runs it)
#   bash benchmarks/gpu_proof.sh --fetch-deps                                      on a Debian machine
#
# What it runs, in this order, each stage under its own time limit (`timeout`, then whatever of its
# process group is left is killed) and all of them within --deadline seconds (default 530), so a
# stage that hangs costs only its own budget and the next stage runs anyway:
#   1. versions: device, driver, CUDA, torch, NCCL, cmake, compiler;
#   2. build: cmake -DZB_WERROR=ON with the machine's nvcc and python3 (torch), CUDA architectures
#      native to the card plus the library's defaults; if that fails, at once again without
#      -Werror (a new compiler's new warning must not cost the run), the stage still failing;
#   3. ctest -L gpu (the C GPU tests), a per-test time limit;
#   4. pytest -m gpu (the torch layer on CUDA, the tutorial on one GPU), a per-test time limit;
#   5. the GPT example (python3 -m zbpp.examples.train_gpt --device cuda): zb-v, gpipe with --offload and interleaved-1f1b
#      with both stages in one process, then 2 and 4 ranks as processes, each kind beside 1F1B
#      (on one GPU the ranks share it, which NCCL refuses: zbpp moves their messages through host
#      memory and warns); tokens/s and measured bubble, the V's timeline as SVG and Chrome trace;
#   6. benchmarks/bench_gpu.py: W GEMM (bf16/fp16/fp32, hidden 1024-8192) against torch.matmul +
#      main_grad.add_ as TFLOP/s and as a fraction of the card's bf16 peak, optimizer and norm
#      kernels in GB/s against a device copy, the runner's per-op overhead;
#   7. compute-sanitizer: memcheck over the kernels' and the W store's GPU tests, racecheck and
#      synccheck over the kernels' test ("not available" where the runtime refuses the device);
#   8. benchmarks/bench_synthetic.py on the machine's CPU cores, p = 4 and 8, zbpp against torch's
#      own schedules (sleeping stages: no GPU needed, many cores).
# Stages 3-7 need the library: when the build made none, they are reported as not run.
# Everything lands in --out (default $OUT, else ./gpu-proof-out): gpu-proof.md (a section per stage:
# status, seconds, command, its output's tail; versions and date at the top) and at most 7 more files
# (logs.txt with every stage's whole log, bench_gpu.json, the GPT timeline as SVG and trace, the
# synthetic table and timeline), so all of it comes back from a device machine (8 files at most).
#
# --dry-run runs the same stages where there is no GPU: the build without CUDA where nvcc is absent
# (or --build-dir of an existing build), the GPU tests reporting their skips,
# bench_gpu.py's host half, the GPT example on the CPU, bench_synthetic on tiny sizes. It fails
# (exit 1) when a stage fails, so the script cannot rot between GPU runs. On a GPU the script exits
# 0 when it ran to the end whatever the stages said: the report is the result.
#
# The GPU machine has no package registry. What the build needs beyond its image (a CBLAS, cmocka,
# pkg-config; cuBLASLt's and NCCL's headers) comes along in .deps/ (ignored by git): run
# --fetch-deps here first (Debian packages into .deps/gpu-debs/; .ci/setup puts the headers in
# .deps/cuda-include/), then on the device tool: run with carry [".deps"] and the command
# `ZBPP_PROOF_COMMIT=<hash> bash benchmarks/gpu_proof.sh` (the machine gets no .git, so the report
# names the commit from there). The packages are unpacked next to the build, never into /.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
dry=0
fetch=0
out=${OUT:-}
build=
deadline=530
while (($#)); do
  case $1 in
    --dry-run) dry=1 ;;
    --fetch-deps) fetch=1 ;;
    --out) out=$2; shift ;;
    --build-dir) build=$2; shift ;;
    --deadline) deadline=$2; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_proof.sh: unknown argument $1 (--dry-run, --fetch-deps, --out DIR, --build-dir DIR, --deadline S)" >&2
       exit 2 ;;
  esac
  shift
done

debs=(libcmocka0 libcmocka-dev libopenblas0-pthread libopenblas-pthread-dev libgfortran5 libquadmath0 pkgconf-bin
      libpkgconf3)
if ((fetch)); then
  mkdir -p .deps/gpu-debs
  (cd .deps/gpu-debs && apt-get download "${debs[@]}") || {
    echo "gpu_proof.sh: apt-get download failed (run apt-get update first?)" >&2; exit 1; }
  du -sh .deps
  echo "now: the device tool's run, carry [\".deps\"], command: bash benchmarks/gpu_proof.sh"
  exit 0
fi

start=$SECONDS
out=${out:-$root/gpu-proof-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-proof.XXXXXX")
trap 'rm -rf "$work"' EXIT
report=$out/gpu-proof.md
logs=$out/logs.txt
: >"$logs"
python=${ZBPP_PROOF_PYTHON:-}
if [[ -z $python ]]; then
  if ((dry)) && [[ -x $root/.venv/bin/python ]]; then python=$root/.venv/bin/python; else python=python3; fi
fi
if ((dry)); then
  gpu=0
else
  gpu=$(timeout 90 "$python" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$root/bindings/python${PYTHONPATH:+:$PYTHONPATH}
failed=()

{
  echo "# zbpp GPU proof"
  echo
  commit=${ZBPP_PROOF_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}
  [[ -z ${ZBPP_PROOF_COMMIT:-} ]] && ! git diff --quiet HEAD 2>/dev/null && commit="$commit (with uncommitted changes)"
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $commit,"
  if ((dry)); then echo "a dry run (no GPU asked for): \`bash benchmarks/gpu_proof.sh --dry-run\`."
  else echo "\`bash benchmarks/gpu_proof.sh\`; a GPU seen by torch: $([[ $gpu == 1 ]] && echo yes || echo NO)."; fi
  echo
  echo "| stage | status | seconds | limit |"
  echo "| --- | --- | --- | --- |"
} >"$report"
sections=$work/sections.md
: >"$sections"

# stage NAME LIMIT TAIL COMMAND: runs COMMAND (a bash string) under `timeout`, at most LIMIT seconds
# and never past the deadline; its output goes to logs.txt (the last 4 MB of it) and its last TAIL
# lines to the report. What is left of its process group afterwards (children that ignored the
# signal) is killed before the next stage. With needs_lib=1, a stage is reported as not run when
# the build made no library.
needs_lib=0
stage() {
  local name=$1 limit=$2 tail_lines=$3 cmd=$4
  local left=$((deadline - (SECONDS - start)))
  local log=$work/$name.log t0=$SECONDS status rc pid why=
  ((limit > left)) && limit=$left
  ((limit < 5)) && why="not run: the deadline (${deadline} s) was reached"
  ((needs_lib)) && [[ ! -e $build/libzbpp.so ]] && why="not run: the build made no libzbpp.so"
  if [[ -n $why ]]; then
    failed+=("$name")
    echo "[gpu_proof] $name: $why"
    echo "| $name | $why | 0 | - |" >>"$report"
    printf '\n## %s\n\n%s\n' "$name" "$why" >>"$sections"
    return
  fi
  echo "[gpu_proof] $name (limit ${limit} s)"
  timeout -k 5 "$limit" bash -c "$cmd" >"$log" 2>&1 </dev/null &
  pid=$!
  wait "$pid"
  rc=$?
  kill -KILL -- "-$pid" 2>/dev/null  # timeout made itself its group's leader: its pid names the group
  case $rc in
    0) status=ok ;;
    124|137) status="TIMED OUT after ${limit} s"; failed+=("$name") ;;
    *) status="FAILED (exit $rc)"; failed+=("$name") ;;
  esac
  echo "[gpu_proof] $name: $status ($((SECONDS - t0)) s)"
  echo "| $name | $status | $((SECONDS - t0)) | $limit |" >>"$report"
  {
    printf '\n## %s\n\n%s in %s s. Command:\n\n```\n%s\n```\n\n' "$name" "$status" "$((SECONDS - t0))" "$cmd"
    printf 'Last %s lines of its output (all of it in logs.txt):\n\n```\n' "$tail_lines"
    tail -n "$tail_lines" "$log"
    printf '```\n'
  } >>"$sections"
  { printf '\n===== %s: %s =====\n' "$name" "$status"; tail -c 4000000 "$log"; } >>"$logs"
}

# ---- 1. versions --------------------------------------------------------------------------------
stage versions 15 40 "
  date -u
  uname -srm
  nproc
  (nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || echo 'nvidia-smi: not found')
  (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>/dev/null || echo 'nvcc: not found') | tail -n 2
  cmake --version | head -n 1
  cc --version | head -n 1
  command -v compute-sanitizer || echo 'compute-sanitizer: not found'
  '$python' -c 'import sys, torch; print(\"python\", sys.version.split()[0]); print(\"torch\", torch.__version__, \"CUDA\", torch.version.cuda, \"available\", torch.cuda.is_available()); print(\"NCCL\", \".\".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else \"-\"); [print(\"device\", i, torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())]'
"

# ---- 2. build -------------------------------------------------------------------------------------
cuda_flags=()
if ((dry)); then
  # A build of its own, as on a GPU, with the CUDA parts where nvcc is found (the library's AUTO:
  # the GPU tests then reach their device check and skip there, as CI's ctest leaves them out);
  # a given --build-dir keeps what it was configured with.
  build=${build:-$work/build}
else
  build=${build:-$root/build-gpu}
  # The card's own architecture (sm_90 for an H100/H200) beside the library's defaults.
  arch=$(timeout 90 "$python" -c 'import torch; c = torch.cuda.get_device_capability(); print(f"{c[0]}{c[1]}")' 2>/dev/null || true)
  archs="80-real;86-real;89-real;90-real;100"
  [[ -n $arch && ";$archs;" != *";$arch-real;"* && ";$archs;" != *";$arch;"* ]] && archs="$archs;$arch-real"
  cuda_flags=(-DZB_ENABLE_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$archs")
fi
mkdir -p "$build"
build=$(cd "$build" && pwd)
# A CBLAS, cmocka and pkg-config from the carried Debian packages where the machine lacks them,
# unpacked next to the build (never into /), in one fixed place so that a second run reuses the
# build instead of configuring it anew.
deps=$build/_gpu_debs
cmake_deps=()
if ! { command -v pkg-config >/dev/null && pkg-config --exists blas && [[ -e /usr/include/cmocka.h ]]; } \
   || [[ -n ${ZBPP_PROOF_FORCE_DEBS:-} ]]; then
  if compgen -G ".deps/gpu-debs/*.deb" >/dev/null; then
    if [[ ! -e $deps/pc/blas.pc ]]; then
      mkdir -p "$deps/pc"
      for f in .deps/gpu-debs/*.deb; do
        dpkg-deb -x "$f" "$deps" || echo "[gpu_proof] unpacking $f failed: the build may miss what it holds"
      done
    fi
    blasdir=$deps/usr/lib/x86_64-linux-gnu/openblas-pthread
    printf '%s\n' "Name: blas" "Description: OpenBLAS (pthread), unpacked for gpu_proof.sh" "Version: 0.3" \
      "Cflags: -I$deps/usr/include/x86_64-linux-gnu/openblas-pthread" "Libs: -L$blasdir -lopenblas" >"$deps/pc/blas.pc"
    export LD_LIBRARY_PATH=$blasdir:$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export PKG_CONFIG_PATH=$deps/pc
    cmake_deps=(-DPKG_CONFIG_EXECUTABLE="$deps/usr/bin/pkgconf" -DCMOCKA_INCLUDE_DIR="$deps/usr/include"
                -DCMOCKA_LIBRARY="$deps/usr/lib/x86_64-linux-gnu/libcmocka.so" -DZB_CBLAS_INCLUDE_DIR="$deps/usr/include/x86_64-linux-gnu/openblas-pthread")
    echo "[gpu_proof] CBLAS, cmocka and pkgconf from .deps/gpu-debs (unpacked in $deps)"
  else
    echo "[gpu_proof] no CBLAS/cmocka/pkg-config here and no .deps/gpu-debs: the build will say what is missing (run --fetch-deps on a Debian machine and carry .deps)"
  fi
fi
generator=()
command -v ninja >/dev/null && [[ ! -f $build/CMakeCache.txt ]] && generator=(-G Ninja)
jobs=$(nproc 2>/dev/null || echo 2)
# No fake CUDA device (tests/fake_cuda): here the GPU tests run on the GPU, and the dry run builds
# what the GPU run builds.
printf -v configure '%q ' cmake -S "$root" -B "$build" "${generator[@]}" -DZB_PYTHON="$(command -v "$python")" \
  -DZB_FAKE_CUDA=OFF "${cuda_flags[@]}" "${cmake_deps[@]}"
# Keep going past a target that fails (-k): the C library and its GPU tests still get built and run
# when, say, the torch ops do not compile against this machine's torch; the stage still fails.
keep=(-k)
[[ ${#generator[@]} -gt 0 || $(grep -s '^CMAKE_GENERATOR:' "$build/CMakeCache.txt") == *Ninja* ]] && keep=(-k 0)
# What every later stage runs loads this build: the tests read ZBPP_BUILD_DIR, but the package
# itself (train_gpt, the benchmarks) looks for ZBPP_LIBRARY / ZBPP_TOOL, else only at build/ of
# the checkout, which a GPU run does not build (it builds in build-gpu/). The build stage checks
# that python's library and tool are this build's: where the checkout also has a build/ (CI's
# dry run), a lost export would load that one instead, and only this check would notice.
export ZBPP_BUILD_DIR=$build ZBPP_LIBRARY=$build/libzbpp.so ZBPP_TOOL=$build/zbpp
loads="import os, zbpp; r = os.path.realpath; b = r('$build'); \
got = {'library': r(zbpp.library_path()), 'tool': r(zbpp.tool_path())}; print('[gpu_proof] python uses', got); \
bad = [f'{k} {v}' for k, v in got.items() if os.path.dirname(v) != b]; \
assert not bad, f'python uses {bad}, not this build ({b})'"
stage build 130 30 "
  if $configure -DZB_WERROR=ON && cmake --build '$build' --parallel $jobs -- ${keep[*]}; then
    '$python' -c \"$loads\"
    exit
  fi
  echo '== the build with -DZB_WERROR=ON failed; again without -Werror so the run goes on (this stage still fails)'
  $configure -DZB_WERROR=OFF && cmake --build '$build' --parallel $jobs -- ${keep[*]} && '$python' -c \"$loads\"
  exit 1"
needs_lib=1

# ---- 3. C GPU tests ----------------------------------------------------------------------------------
stage ctest-gpu 45 30 "ctest --test-dir '$build' -L gpu --output-on-failure --timeout 25"

# ---- 4. Python GPU tests ---------------------------------------------------------------------------
per_test=()
timeout 60 "$python" -c 'import pytest_timeout' 2>/dev/null && per_test=(-p timeout --timeout 60)
stage pytest-gpu 110 45 "'$python' -m pytest -v -rfEs -p no:cacheprovider -m gpu ${per_test[*]} tests/python"

# ---- 5. the GPT example ----------------------------------------------------------------------------------
# One process holding a V's two stages, then 2 and 4 ranks as processes (on one GPU they share it:
# NCCL refuses that, so zbpp stages their messages through host memory, and says so), each schedule
# kind beside 1F1B: tokens/s and the measured bubble from each run's last line; then a large
# vocabulary on the last stage and split over the ranks (--vocab-parallel). Each run has its
# own limit, so one that hangs costs only that.
if ((gpu)); then
  size="--device cuda --d-model 512 --layers 8 --heads 8 --seq 128 --batch 64 --microbatches 8 --steps 10 --timeout 20"
  vocab=32768
else
  size="--device cpu --d-model 32 --layers 8 --heads 2 --seq 16 --batch 16 --microbatches 4 --steps 4 --timeout 20"
  vocab=256
fi
stage gpt 115 50 "
  bad=0
  gpt() { echo \"== train_gpt \$*\"; timeout --foreground -k 3 40 '$python' -m zbpp.examples.train_gpt --quiet $size \\
          --out '$work/gpt' \"\$@\" 2>&1 | grep -v '^  wrote'; rc=\${PIPESTATUS[0]}
          [[ \$rc == 0 ]] || { echo \"== exit \$rc\"; bad=1; }; return \$rc; }
  gpt --ranks 1 --schedule zb-v
  cp '$work'/gpt/train_gpt-zb-v.svg '$out'/gpt-zb-v.svg
  cp '$work'/gpt/train_gpt-zb-v-trace.json '$out'/gpt-zb-v-trace.json
  # PipeOffload's CUDA copies (a copy stream, pinned memory), their times measured in steps 2-3:
  # GPipe on one rank, where every microbatch's activations wait (a V on one rank moves nothing).
  off=\$(gpt --ranks 1 --schedule gpipe --offload) || bad=1; echo \"\$off\"
  grep -Eq ', [1-9][0-9,]* KiB in host memory' <<<\"\$off\" || { echo '== offload moved nothing'; bad=1; }
  gpt --ranks 1 --schedule interleaved-1f1b --chunks 2
  for kind in 1f1b zb-h1 zb-auto; do gpt --ranks 2 --schedule \$kind; done
  for kind in 1f1b zb-v zb-auto; do gpt --ranks 4 --schedule \$kind; done
  # Vocabulary Parallelism on CUDA stages: the passes on the GPU, their collectives through host memory
  gpt --ranks 2 --schedule 1f1b --vocab-size $vocab
  gpt --ranks 2 --schedule 1f1b --vocab-size $vocab --vocab-parallel
  exit \$bad"

# ---- 6. bench_gpu ----------------------------------------------------------------------------------------
if ((gpu)); then
  stage bench-gpu 60 60 "'$python' benchmarks/bench_gpu.py --json '$out/bench_gpu.json'"
else
  stage bench-gpu 40 20 "'$python' benchmarks/bench_gpu.py --host-only --quick --json '$out/bench_gpu.json'"
fi

# ---- 7. compute-sanitizer ------------------------------------------------------------------------------
if ((gpu)) && command -v compute-sanitizer >/dev/null; then
  # Each tool run has its own limit inside the stage's (--foreground: killed with the stage), and a
  # failing one does not stop the others. Where the runtime refuses the device to the sanitizer
  # ("Device not supported", as on gVisor), the stage says so instead of failing.
  cs="compute-sanitizer --error-exitcode 99 --print-limit 20"
  stage sanitizer 50 45 "
    bad=0
    run() { echo \"== \$*\"; timeout --foreground -k 2 \"\$1\" \"\${@:2}\" 2>&1 | tee -a '$work/cs.log'
            rc=\${PIPESTATUS[0]}; echo \"== exit \$rc\"; [[ \$rc == 0 ]] || bad=1; }
    run 20 $cs --tool memcheck '$build'/gpu_kernels
    if grep -q 'Device not supported' '$work/cs.log'; then echo 'compute-sanitizer: not available on this runtime'; exit 0; fi
    run 15 $cs --tool memcheck '$build'/gpu_wgrad
    run 10 $cs --tool racecheck '$build'/gpu_kernels
    run 10 $cs --tool synccheck '$build'/gpu_kernels
    exit \$bad"
else
  # The same test programs without the sanitizer: they report their skip (exit 77) where no GPU is.
  stage sanitizer 30 10 "
    echo 'compute-sanitizer not run: $( ((gpu)) && echo 'not installed' || echo 'no GPU')'
    for t in gpu_kernels gpu_wgrad; do '$build'/\$t; rc=\$?; echo \"\$t: exit \$rc\"; [[ \$rc == 0 || \$rc == 77 ]] || exit \$rc; done"
fi

# ---- 8. bench_synthetic on the CPU cores ----------------------------------------------------------------
if ((gpu)); then
  syn="--p 4,8 --m 2p --costs equal --equal-ms 4 --classes Schedule1F1B,ScheduleZBVZeroBubble,ScheduleInterleavedZeroBubble,zb-v,zb-auto@p --reps 3 --steps 1 --warmup 4 --record-steps 1"
else
  syn="--p 4 --m 8 --costs equal --classes Schedule1F1B,ScheduleZBVZeroBubble,zb-v --equal-ms 2 --reps 1 --steps 1 --record-steps 1"
fi
stage synthetic 45 40 "'$python' benchmarks/bench_synthetic.py $syn --out '$work/syn' && cp '$work/syn/table.md' '$out/synthetic.md' && cp '$work/syn/timeline.svg' '$out/synthetic-timeline.svg'"

# ---- the report -----------------------------------------------------------------------------------------
{
  echo
  if ((${#failed[@]})); then echo "Stages that did not pass: ${failed[*]}."; else echo "Every stage passed."; fi
  echo "Whole run: $((SECONDS - start)) s (deadline $deadline s). Files: $(cd "$out" && ls | tr '\n' ' ')"
  cat "$sections"
} >>"$report"
echo "[gpu_proof] wrote $report ($((SECONDS - start)) s); stages that did not pass: ${failed[*]:-none}"
if ((dry)) && ((${#failed[@]})); then
  cat "$report"
  exit 1
fi
exit 0
