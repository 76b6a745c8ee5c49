#!/usr/bin/env bash
# The whole GPU check in one command, for the 2x H200 device machine (or any CUDA box):
#   bash scripts/gpu_suite.sh [stage ...]      stages: build probe kernel overlay bench verify (default: all but probe)
# Builds sgl_kernel_sm120._C for the visible GPUs (TORCH_CUDA_ARCH_LIST, default 9.0a), runs the GPU tests and
# the benchmarks, and leaves logs, junit XML, JSON and plots under $OUT (default ./gpu-out), packed into
# $OUT/gpu-suite.tar.gz as well (the device tool brings back at most 8 files).
# Wheels for SGLang's CPU-side stack (../shared/tools/fetch_sglang_gpu_wheels.sh) are taken from ./.whl when
# present and installed into a scratch folder put first on PYTHONPATH; nothing is fetched from a registry.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT/logs" "$OUT/results"
stages=${*:-build kernel overlay bench verify}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
status=0
step() {  # step NAME COMMAND...: run, log, remember failure, go on
  local name=$1; shift
  echo ">>> [$(date +%T)] $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/logs/$name.log"
  echo ">>> $name rc=$rc in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || status=1
  return $rc
}
has() { [[ " $stages " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/logs/gpus.csv" 2>&1
nvidia-smi topo -m >> "$OUT/logs/gpus.csv" 2>&1
if ls .whl/*.whl > /dev/null 2>&1; then
  SITE=$(mktemp -d)
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
    > "$OUT/logs/wheels.log" 2>&1 || echo ">>> wheel install failed (see logs/wheels.log)"
  export PYTHONPATH="$SITE:$PWD:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD:$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi

if has build; then
  step build $PY setup.py build_ext --inplace || { echo "build failed"; tar -czf "$OUT/gpu-suite.tar.gz" -C "$OUT" logs; exit 1; }
fi
if has probe; then
  step probe torchrun --nproc-per-node 2 scripts/probe_latency.py
fi
if has kernel; then
  step kernel-tests $PY -m pytest -m gpu -v tests/gpu/test_ipc_allreduce.py -k "not oversubscribed" \
    --junitxml="$OUT/results/junit-kernel.xml"
  step kernel-tests-oversubscribed $PY -m pytest -m gpu -v tests/gpu/test_ipc_allreduce.py -k oversubscribed \
    --junitxml="$OUT/results/junit-kernel-oversubscribed.xml"
fi
if has overlay; then
  step overlay-tests $PY -m pytest -m gpu -v tests/gpu/test_sglang_integration.py --junitxml="$OUT/results/junit-overlay.xml"
fi
if has bench; then
  step bench-allreduce torchrun --nproc-per-node 2 benchmarks/bench_allreduce.py --out "$OUT/results"
fi
if has verify; then
  step bench-verify-none torchrun --nproc-per-node 2 benchmarks/bench_verify.py --compute none --out "$OUT/results"
  step bench-verify-gemm torchrun --nproc-per-node 2 benchmarks/bench_verify.py --compute gemm --out "$OUT/results"
  step verify-gpu-test $PY -m pytest -m gpu -v tests/gpu/test_bench_verify_gpu.py
fi
tar -czf "$OUT/gpu-suite.tar.gz" -C "$OUT" logs results
echo ">>> suite status=$status"
exit $status
