#!/usr/bin/env bash
# The whole GPU check in one command, for the 2x H200 device machine (or any CUDA box):
#   OUT=/some/dir [STAGE_TIMEOUT_S=900] bash scripts/gpu_suite.sh [stage ...]
#   (every stage is cut off after STAGE_TIMEOUT_S seconds, its processes killed; the stages after it still run;
#   pytest writes a stage's junit XML only at its end, so a stage cut off leaves none)
#   TEST_SELECT=EXPR: a pytest -k expression ANDed with each pytest stage's own selection, to split a long stage
#   over device calls (e.g. TEST_SELECT="late_peer or probe" ... kernel). PYTEST_ADDOPTS="-k ..." cannot do
#   this: a stage's own -k comes later on the command line and wins.
#   stages: build kernel bench verify oversubscribed negative overlay probe nop2p hostmem trapdiag junit
#   transports: tests/gpu/test_transports.py (push / staged / pull, processes sharing the GPU and one process running
#   the ranks concurrently, and the transports' negative controls); bench-transports: benchmarks/bench_transports.py
#   tuner-pick: benchmarks/bench_tuner_pick.py (the one-process quick tune's pick against a sweep of every launch, at
#   2, 4 and 8 ranks; tuner_pick_<gpu>_concurrent.json)
#   bench-tune: benchmarks/bench_tune.py (how long the launcher's first tune takes, per phase, one process at TP 2,
#   4, 8 and processes sharing the GPU at TP=2, and the full tune; tune_duration_<gpu>.json; BENCH_TUNE_ARGS)
#   profile-transports: Nsight Compute (ncu, or $NCU) on each case of benchmarks/profile_transports.py (the
#   transports' speed misses), each report and its details page as results/ncu_<gpu>_<case>.{ncu-rep,txt} (in the tarball)
#   trapdiag: scripts/diagnose_trap_delivery.py at 8 ranks (does a kernel trap reach every process sharing a GPU?)
#   junit: merge the stages' junit XML into $OUT/gpu_tests_<gpu>_tp<N>.xml (N: GPUs the ranks ran on)
#   build compiles the kernels in place, or puts in place the library carried in .device-lib (made on the dev
#   machine by scripts/device_lib.py build) when it matches these sources, Python, torch and archs and loads, and
#   the negative-control builds carried in .device-lib-negative (device_lib.py build --negative) likewise;
#   build also starts the negative-control builds in the background (tests/gpu/negative_builds.py), which
#   the negative stage then uses (NEGATIVE_BUILDS=0: not started)
#   sglang-server: a real `sglang.launch_server` per release in SGL_RELEASES (default "0.5.23 0.5.13.post1"; TP=2
#   on one GPU, a random Kimi-K2.5 with EAGLE-3, on against off; tests/gpu/test_sglang_server.py) from the
#   .sgls/<release> carry of scripts/pack_sglang_server.py (one release a device call: carry ".sgls/<release>" and
#   set SGL_RELEASES to it); per release junit gpu_tests_<gpu>_server_shared_<release>.xml, verdicts and numbers
#   server_test_<gpu>_shared_<release>.json, server logs in the tarball (logs/server/<release>/); run it without
#   the negative builds beside it (NEGATIVE_BUILDS=0): they compete for the CPUs with the servers' compiles
#   hostmem: the kernel tests with the workspace in host memory (tests/gpu/test_hostmem_allreduce.py)
#   sglang-shared: the SGLang-level GPU tests on each SGLang release in turn (SGL_RELEASES, default
#   "0.5.23 0.5.13.post1"), ranks sharing the GPU(s) with SGLang's groups on gloo (tests/gpu/sglang_harness.py):
#   integration, probe fallback, breakable graph (0.5.23), bench_verify --shared-gpu --via-sglang. Needs the
#   kernels built (stage build) and the .sgl carry (python3 scripts/pack_sglang_gpu.py on the dev machine,
#   carry ".sgl"); each release is installed from it into $WORK/sgl-<release> and put first on PYTHONPATH for
#   its tests only. junit XML: $WORK/results/gpu_tests_<gpu>_sglang_shared.xml (both releases, one testsuite
#   each; copied to $OUT), per release gpu_tests_<gpu>_sglang_shared_<release>.xml.
#   e.g. `OUT=dir bash scripts/gpu_suite.sh build sglang-shared`
#   tune: `python -m sglang_sm120.tune --quick` (hidden 7168, rows up to 8 x 4), its table copied to
#   $WORK/results/tune_<gpu>_shared.json (one GPU: ranks share it and --debug-nccl-us stands in for NCCL, which
#   cannot start there: plumbing only, the times mean nothing) or tune_<gpu>_tp<N>.json, then
#   tests/gpu/test_tune_gpu.py (tune -> table -> a group routing by it -> the activation line; the start-up tune)
#   (default: all but probe and nop2p, in that order: the benchmarks come before the slow correctness-only tests)
#   nop2p: both benchmarks with --no-p2p: ours through pinned host memory (sm120_hostmem) against NCCL with
#   NCCL_P2P_DISABLE=1 (nccl_no_p2p; each script sets the variable itself, before NCCL starts), writing
#   allreduce_<gpu>_tp<N>_nop2p.json and verify_<gpu>_tp<N>_nop2p.json (+ plots);
#   e.g. `OUT=dir bash scripts/gpu_suite.sh build nop2p`
# Builds the kernels (sgl_kernel_sm120/_C_torch<ver>_cuda<ver>*.so, in place) for TORCH_CUDA_ARCH_LIST, by
# default the architectures of the visible GPUs only (9.0a on the H200s, 12.0a on an RTX PRO 6000 box), then runs
# the GPU tests and the benchmarks.
# Logs, junit XML, JSON and plots go to $WORK (default /tmp/gpu-suite); after every step $OUT receives an
# up-to-date gpu-suite.tar.gz of it, the result JSON/PNG files, and summary.log (the device tool brings back
# at most 8 files, and whatever is in $OUT when a command is cut off).
# Wheels for SGLang's CPU-side stack (see the project's shared tools) are taken from ./.whl when
# present and installed into a scratch folder put first on PYTHONPATH; nothing is fetched from a registry.
# (The sglang-shared stage does not use them: it installs each release from .sgl, see above.)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
WORK=${WORK:-/tmp/gpu-suite}
mkdir -p "$OUT" "$WORK/logs" "$WORK/results"
stages=${*:-build kernel bench verify oversubscribed negative overlay}
PY=${PY:-python3}
visible_archs() {  # "9.0a" / "12.0a" / "9.0a;12.0a": one entry per distinct capability of the visible GPUs
  $PY -c "import torch; print(';'.join(sorted({'%d.%d' % c + ('a' if c[0] >= 9 else '') for c in
          (torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))})))"
}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
# Keep what the ranks print (a hanging rank's stack dump above all) in the junit XML that comes back.
export PYTEST_ADDOPTS="${PYTEST_ADDOPTS:-} -o junit_logging=all"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$(visible_archs)}
[ -n "$TORCH_CUDA_ARCH_LIST" ] || { echo "no visible CUDA GPU: set TORCH_CUDA_ARCH_LIST"; exit 1; }
echo ">>> building for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
# One GPU: multi-rank tests run with their ranks sharing it (correctness only).
[ "$NGPU" -lt 2 ] && export SGL_SM120_TEST_SHARE_GPUS=${SGL_SM120_TEST_SHARE_GPUS:-1}
GPU_TAG=$($PY -c "import re, torch; n=torch.cuda.get_device_name(0).lower(); m=re.search(r'\bh\d00\b', n)
print(m.group() if m else re.sub(r'[^a-z0-9]+', '_', n.replace('nvidia', '')).strip('_'))")
export SGL_SM120_NEGATIVE_BUILDS=${SGL_SM120_NEGATIVE_BUILDS:-$WORK/negative-builds}
status=0
kexpr() {  # kexpr [BASE]: the stage's -k expression, BASE and TEST_SELECT combined ("" selects everything)
  local base=${1:-} extra=${TEST_SELECT:-}
  if [ -n "$base" ] && [ -n "$extra" ]; then echo "($base) and ($extra)"; else echo "$base$extra"; fi
}
publish() {
  tar -czf "$OUT/gpu-suite.tar.gz" -C "$WORK" logs results 2>/dev/null
  cp "$WORK"/results/*.json "$WORK"/results/*.png "$OUT"/ 2>/dev/null
  true
}
step() {  # step NAME COMMAND...: run, log, remember failure, go on
  local name=$1; shift
  echo ">>> [$(date +%T)] $name: $*" | tee -a "$OUT/summary.log"
  local t0=$SECONDS
  # Bounded (STAGE_TIMEOUT_S, default 900 s): a hung stage ends here, its process group killed, and the stages
  # after it still run inside the device call's own limit.
  timeout -k 15 "${STAGE_TIMEOUT_S:-900}" "$@" > "$WORK/logs/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo ">>> $name: cut off after ${STAGE_TIMEOUT_S:-900} s (STAGE_TIMEOUT_S)" | tee -a "$OUT/summary.log"
  tail -n 15 "$WORK/logs/$name.log"
  grep -E "passed|failed|error" "$WORK/logs/$name.log" | tail -n 3 >> "$OUT/summary.log"
  echo ">>> $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.log"
  [ $rc -eq 0 ] || status=1
  publish
  return $rc
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m; } > "$WORK/logs/gpus.txt" 2>&1
if ls .whl/*.whl > /dev/null 2>&1; then
  SITE=$(mktemp -d)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
    > "$WORK/logs/wheels.log" 2>&1 || echo ">>> wheel install failed (see logs/wheels.log)"
  export PYTHONPATH="$SITE:$PWD:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi
# FlashInfer's PCIe IPC all-reduce for the bench peer flashinfer_pcie_ipc: a trimmed FlashInfer in .fi/site and the
# wheels it needs in .fi/wheels, made by scripts/pack_flashinfer_pcie.sh (carry ".fi"). Only the bench stage sees it:
# the other stages import SGLang broadly, which on a GPU machine expects the stand-ins for a missing FlashInfer
# (benchmarks/harness/standins.py), and this copy holds the PCIe all-reduce only. Its tvm-ffi goes first
# (FlashInfer 0.7.2 asks >= 0.1.11; .whl's SGLang 0.5.13.post1 pins 0.1.9).
BASE_PYTHONPATH="$PWD:$PWD/python"  # what the sglang-shared stage puts after a release's own folder

sgl_site() {  # sgl_site RELEASE: install that release's trimmed SGLang and its wheels from .sgl; prints the folder
  local rel=$1 site=$WORK/sgl-$1
  if [ ! -f ".sgl/$rel/sglang.tar.xz" ]; then
    echo ">>> no .sgl/$rel: run python3 scripts/pack_sglang_gpu.py on the dev machine and carry .sgl" >&2
    return 1
  fi
  rm -rf "$site" && mkdir -p "$site" || return 1
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    .sgl/common/wheels/*.whl ".sgl/$rel"/wheels/*.whl > "$WORK/logs/sgl-$rel-install.log" 2>&1 || return 1
  $PY -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
    ".sgl/$rel/sglang.tar.xz" "$site" >> "$WORK/logs/sgl-$rel-install.log" 2>&1 || return 1
  echo "$site"
}

merge_junit() {  # merge_junit OUT.xml RELEASE=FILE...: one <testsuites>, each release's suite named after it, strict
  local out=$1; shift
  local labelled=()
  for part in "$@"; do labelled+=("sglang ${part%%=*} (ranks sharing the GPU, SGLang on gloo)=${part#*=}"); done
  $PY scripts/merge_junit.py --strict "$out" "${labelled[@]}"
}

FI_PATH=
if [ -d .fi/site ]; then
  FI_DEPS=$(mktemp -d)
  if ls .fi/wheels/*.whl > /dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$FI_DEPS" .fi/wheels/*.whl \
      > "$WORK/logs/fi-wheels.log" 2>&1 || echo ">>> .fi wheel install failed (see logs/fi-wheels.log)"
  fi
  FI_PATH="$PWD/.fi/site:$FI_DEPS:"
  echo ">>> bench stage gets FlashInfer (PCIe IPC only) from .fi/site" | tee -a "$OUT/summary.log"
fi

for stage in $stages; do
  case $stage in
    build) # a library carried in .device-lib (scripts/device_lib.py build, on the dev machine) saves the compile
           # when it was built from these sources for this Python, torch and archs, and loads; else it compiles
           if ! $PY scripts/device_lib.py install 2>&1 | tee -a "$OUT/summary.log"; then
             step build $PY setup.py build_ext --inplace || { echo "build failed"; exit 1; }
           fi
           # the negative-control builds carried in .device-lib-negative (device_lib.py build --negative), when
           # they match as the library must; the background builds below then find them and compile nothing
           [ -d .device-lib-negative ] && $PY scripts/device_lib.py install-negative "$SGL_SM120_NEGATIVE_BUILDS" 2>&1 \
             | tee -a "$OUT/summary.log"
           # NEGATIVE_BUILDS=0 skips them: they compete for the CPUs with what runs next (the server stage's
           # JIT and Triton compiles took 30% longer beside them on an H200)
           if [ "${NEGATIVE_BUILDS:-1}" != 0 ]; then
             $PY -m tests.gpu.negative_builds "$SGL_SM120_NEGATIVE_BUILDS" > "$WORK/logs/negative-builds.log" 2>&1 &
             echo ">>> negative-control builds started in the background (pid $!)" | tee -a "$OUT/summary.log"
           fi ;;
    probe) step probe torchrun --nproc-per-node "$NGPU" scripts/probe_latency.py ;;
    kernel) step kernel-tests $PY -m pytest -m gpu -v tests/gpu/test_ipc_allreduce.py -k "$(kexpr "not oversubscribed")" \
              --junitxml="$WORK/results/junit-kernel.xml" ;;
    bench) PYTHONPATH="$FI_PATH$PYTHONPATH" BENCH_TIME_LIMIT_S=${BENCH_TIME_LIMIT_S:-170} step bench-allreduce torchrun --nproc-per-node "$NGPU" benchmarks/bench_allreduce.py --out "$WORK/results" ;;
    nop2p)
      BENCH_TIME_LIMIT_S=${NOP2P_TIME_LIMIT_S:-240} step bench-allreduce-nop2p torchrun --nproc-per-node "$NGPU" \
        benchmarks/bench_allreduce.py --no-p2p --out "$WORK/results"
      BENCH_TIME_LIMIT_S=${NOP2P_VERIFY_TIME_LIMIT_S:-220} step bench-verify-nop2p torchrun --nproc-per-node "$NGPU" \
        benchmarks/bench_verify.py --no-p2p --compute none --out "$WORK/results" ;;
    verify)
      BENCH_TIME_LIMIT_S=${VERIFY_TIME_LIMIT_S:-220} step bench-verify torchrun --nproc-per-node "$NGPU" \
        benchmarks/bench_verify.py --compute none,gemm --via-sglang --sglang-custom-ar on \
        --out "$WORK/results"
      step verify-gpu-test $PY -m pytest -m gpu -v -k "$(kexpr)" tests/gpu/test_bench_verify_gpu.py ;;
    hostmem) step hostmem-tests $PY -m pytest -m gpu -v -k "$(kexpr)" tests/gpu/test_hostmem_allreduce.py \
              --junitxml="$WORK/results/junit-hostmem.xml" ;;
    tune) if [ "$NGPU" -lt 2 ]; then tune_args=(--tp 2 --share-gpu --debug-nccl-us 1000000); tune_name=shared
          else tune_args=(); tune_name=tp$NGPU; fi
          SGLANG_SM120_CACHE="$WORK/tune-cache" step tune $PY -m sglang_sm120.tune --hidden 7168 --quick \
            --max-batch 8 --draft-tokens 4 ${tune_args[@]+"${tune_args[@]}"} --out "$WORK/results/tune_${GPU_TAG}_${tune_name}.json"
          step tune-gpu-test $PY -m pytest -m gpu -v -k "$(kexpr)" tests/gpu/test_tune_gpu.py \
            --junitxml="$WORK/results/junit-tune.xml" ;;
    oversubscribed) step kernel-tests-oversubscribed $PY -m pytest -m gpu -v tests/gpu/test_ipc_allreduce.py \
              -k "$(kexpr oversubscribed)" --junitxml="$WORK/results/junit-kernel-oversubscribed.xml" ;;
    negative) [ -d "$SGL_SM120_NEGATIVE_BUILDS" ] || $PY -m tests.gpu.negative_builds "$SGL_SM120_NEGATIVE_BUILDS" \
                > "$WORK/logs/negative-builds.log" 2>&1
              while pgrep -f "tests.gpu.negative_builds" > /dev/null; do sleep 2; done  # the background builds
              step negative-controls $PY -m pytest -m gpu -v -k "$(kexpr)" tests/gpu/test_negative_controls.py \
              --junitxml="$WORK/results/junit-negative.xml" ;;
    transports) step transport-tests $PY -m pytest -m gpu -v -k "$(kexpr)" tests/gpu/test_transports.py \
              --junitxml="$WORK/results/junit-transports.xml" ;;
    bench-transports) step bench-transports $PY -m benchmarks.bench_transports --out "$WORK/results" ;;
    tuner-pick) step tuner-pick $PY -m benchmarks.bench_tuner_pick --out "$WORK/results" ;;
    bench-tune) step bench-tune $PY -m benchmarks.bench_tune ${BENCH_TUNE_ARGS:-} \
                  --out "$WORK/results/tune_duration_${GPU_TAG}.json" ;;
    profile-transports)  # Nsight Compute on each case of benchmarks/profile_transports.py (the speed misses)
      NCU=${NCU:-$(command -v ncu || echo "$CUDA_HOME/bin/ncu")}
      for case in $($PY -m benchmarks.profile_transports --list); do
        rep="$WORK/results/ncu_${GPU_TAG}_$case"
        step "ncu-$case" "$NCU" --clock-control none --kernel-name regex:"all_reduce|rmsnorm" --launch-skip 5 \
          --launch-count 1 --set full -f -o "$rep" $PY -m benchmarks.profile_transports --case "$case" \
          && "$NCU" --import "$rep.ncu-rep" --page details > "$rep.txt" 2>&1
      done
      publish ;;
    trapdiag) step trap-diagnosis $PY scripts/diagnose_trap_delivery.py --world 8 --abort-after 5 \
              --out "$WORK/results/trap_delivery_${GPU_TAG}_w8.json" ;;
    junit) step junit $PY scripts/merge_junit.py "$OUT/gpu_tests_${GPU_TAG}_tp${NGPU}.xml" $WORK/results/junit-*.xml ;;
    overlay) step overlay-tests $PY -m pytest -m gpu -v -k "$(kexpr)" tests/gpu/test_sglang_integration.py \
              --junitxml="$WORK/results/junit-overlay.xml" ;;
    sglang-shared)
      gpu=$GPU_TAG
      parts=()
      for rel in ${SGL_RELEASES:-0.5.23 0.5.13.post1}; do
        xml="$WORK/results/gpu_tests_${gpu}_sglang_shared_$rel.xml"
        parts+=("$rel=$xml")
        if ! site=$(sgl_site "$rel"); then
          echo ">>> sglang $rel: install failed (logs/sgl-$rel-install.log)" | tee -a "$OUT/summary.log"; status=1; continue
        fi
        tests=(tests/gpu/test_sglang_integration.py tests/gpu/test_overlay_probe_fallback.py
               tests/gpu/test_bench_verify_gpu.py::test_verify_via_sglang_shared_gpu_is_exactly_ours)
        [ "$rel" = 0.5.23 ] && tests+=(tests/gpu/test_breakable_graph.py)
        PYTHONPATH="$site:$BASE_PYTHONPATH" SGL_SM120_TEST_SHARE_GPUS=1 step "sglang-shared-$rel" \
          $PY -m pytest -m gpu -v -rs -p no:cacheprovider -k "$(kexpr)" "${tests[@]}" --junitxml="$xml"
      done
      merge_junit "$WORK/results/gpu_tests_${gpu}_sglang_shared.xml" "${parts[@]}" | tee -a "$OUT/summary.log" \
        || { echo ">>> sglang-shared: a test failed, errored or was skipped (each must run here)" \
             | tee -a "$OUT/summary.log"; status=1; }
      cp "$WORK/results/gpu_tests_${gpu}_sglang_shared.xml" "$OUT/" 2>/dev/null
      publish ;;
    sglang-server)
      # A real `sglang.launch_server` per release in SGL_RELEASES (TP=2 on one GPU, EAGLE-3, on/off): the
      # .sgls/<release> carry of scripts/pack_sglang_server.py (SGLang with its JIT sources, sglang-kernel 0.4.3
      # trimmed to sm90, the server's wheels), installed into $WORK/sgls-<release>
      gpu=$GPU_TAG
      for rel in ${SGL_RELEASES:-0.5.23 0.5.13.post1}; do
        site=$WORK/sgls-$rel
        if [ ! -f ".sgls/$rel/sglang.tar.xz" ]; then
          echo ">>> no .sgls/$rel: run python3 scripts/pack_sglang_server.py --release $rel on the dev machine and" \
               "carry .sgls/$rel" | tee -a "$OUT/summary.log"; status=1; continue
        fi
        rm -rf "$site" && mkdir -p "$site"
        if ! { $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
                 ".sgls/$rel"/wheels/*.whl &&
               for a in sglang sgl_kernel; do
                 $PY -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
                   ".sgls/$rel/$a.tar.xz" "$site" || exit 1
               done; } > "$WORK/logs/sgls-$rel-install.log" 2>&1; then
          echo ">>> sglang-server $rel: install failed (logs/sgls-$rel-install.log)" | tee -a "$OUT/summary.log"
          status=1; continue
        fi
        mkdir -p "$WORK/logs/server/$rel"
        PYTHONPATH="$site:$BASE_PYTHONPATH" SGLANG_SM120_SERVER_TEST_OUT="$WORK/logs/server/$rel" step "sglang-server-$rel" \
          $PY -m pytest -m gpu -v -rs -p no:cacheprovider -k "$(kexpr)" tests/gpu/test_sglang_server.py \
          --junitxml="$WORK/results/gpu_tests_${gpu}_server_shared_$rel.xml"
        cp "$WORK/logs/server/$rel/server_test.json" "$WORK/results/server_test_${gpu}_shared_$rel.json" 2>/dev/null
        cp "$WORK/results/gpu_tests_${gpu}_server_shared_$rel.xml" "$OUT/" 2>/dev/null
      done
      publish ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
echo ">>> suite status=$status" | tee -a "$OUT/summary.log"
exit $status
