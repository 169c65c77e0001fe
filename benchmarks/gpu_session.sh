#!/usr/bin/env bash
# The one script a session with a GPU runs (through the device tool) to build
# pycollectives with CUDA, run every CUDA test and every CUDA benchmark.
#
#   bash benchmarks/gpu_session.sh [build] [test] [bench] [sanitize]
#                                            (no argument: build test bench)
#
# Steps:
#   build  nvidia-smi, then `pip install --no-build-isolation --no-deps -e .` with
#          PYCOLL_CUDA=1 (the device machine has no network; its python3 has torch,
#          pybind11 and nvcc 13.0), then checks that _C.cuda_built() is True.
#   test   python -m pytest -q -m cuda tests/ (every CUDA test, part 2's included),
#          then the unmarked tests of tests/cuda/test_cuda_kernels.py (device queries,
#          the clear error without a visible device).
#   bench  every benchmarks/cuda/cuda_*.py (cuda_collectives, cuda_kernels, cuda_profile: where a
#          collective's time goes, cuda_staging: what host staging across hosts costs), each
#          under `timeout` (cuda_collectives' sweep takes minutes: its first 2-rank run, checked
#          with -c 1 up to 1 GiB, had not ended after 55 s on 2026-11-27); a script whose --help
#          mentions --json is given --json $OUT/<name>.json. docs/benchmarks.md
#          (whose sections the scripts rewrite) is copied to $OUT.
#   sanitize  (optional) compute-sanitizer memcheck over a subset of
#          tests/cuda/test_cuda_kernels.py (out-of-bounds and misaligned accesses).
# `test`, `bench` and `sanitize` build first when the extension there is missing or has no
# CUDA (a fresh machine), so each can run alone in its own call.
#
# A build made elsewhere can be carried instead (the device tool's `carry`): on a machine with
# nvcc and the device's Python (3.12 there), `PYCOLL_CUDA=1 python3.12 setup.py build_ext
# --inplace`, then carry pycollectives/_C.cpython-312-x86_64-linux-gnu.so; the steps find it
# (PYTHONPATH is the repository) and skip the build, which saves minutes of device time.
#
# Every step runs under its own timeout (GPU_SESSION_{BUILD,TEST,BENCH}_TIMEOUT
# seconds) and the script goes on past a failing step; it prints each step's
# exit code at the end and exits non-zero if any failed. Everything printed is
# also in $OUT/session.log (one file: the device tool returns at most 8).
# One device command may run 10 minutes: `build test` fits in one call and
# `bench` in another.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-/tmp/gpu_session_out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
BUILD_TIMEOUT=${GPU_SESSION_BUILD_TIMEOUT:-240}
TEST_TIMEOUT=${GPU_SESSION_TEST_TIMEOUT:-300}
BENCH_TIMEOUT=${GPU_SESSION_BENCH_TIMEOUT:-420}

if ! command -v nvcc >/dev/null; then
  for d in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-13.0; do
    if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then
      export PATH="$d/bin:$PATH"
      break
    fi
  done
fi

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build test bench)
for s in "${steps[@]}"; do
  case "$s" in
    build | test | bench | sanitize) ;;
    *)
      echo "gpu_session.sh: unknown step '$s' (build, test, bench, sanitize)" >&2
      exit 2
      ;;
  esac
done

results=()
record() { # record NAME RC
  results+=("$1=$2")
  echo "== step $1: exit $2"
}

# run NAME TIMEOUT CMD...: runs CMD under timeout and records its exit code.
run() {
  local name=$1 limit=$2
  shift 2
  echo "== $name (timeout ${limit}s): $*"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "== $name took $((SECONDS - t0)) s"
  record "$name" "$rc"
  return "$rc"
}

cuda_ready() {
  "$PY" -c 'from pycollectives import _C; import sys; sys.exit(0 if _C.cuda_built() else 1)' \
    2>/dev/null
}

do_build() {
  echo "== machine"
  nvidia-smi || true
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
  command -v nvcc && nvcc --version | tail -2
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "no device")'
  run build "$BUILD_TIMEOUT" env PYCOLL_CUDA=1 "$PY" -m pip install --no-build-isolation --no-deps \
    --no-index -e . || return
  run build_check 60 "$PY" -c '
from pycollectives import _C
print("cuda_built", _C.cuda_built(), "cuda_device_count", _C.cuda_device_count())
assert _C.cuda_built(), "the build has no CUDA kernels"
'
}

ensure_built() {
  if ! cuda_ready; then
    echo "== the extension is missing or has no CUDA here: building first"
    do_build || return
  fi
  # A carried build (no pip install) imports pycollectives from this tree, where the strategies
  # live beside the package: a link gives them the name an install gives (pycollectives.strategies).
  if ! "$PY" -c 'import pycollectives.strategies' 2>/dev/null && [ ! -e pycollectives/strategies ]; then
    ln -s ../strategies pycollectives/strategies && echo "== linked pycollectives/strategies"
  fi
}

do_test() {
  ensure_built || return
  # 4 at a time where pytest-xdist is there (about 140 s on an H100 on 2026-11-27, 300+ s one by
  # one); -v names each test as it ends, so a run cut by its timeout still says what failed.
  local par=()
  "$PY" -c 'import xdist' 2>/dev/null && par=(-n 4)
  run test_cuda "$TEST_TIMEOUT" "$PY" -m pytest -v -m cuda -rfEs --tb=short "${par[@]}" \
    --continue-on-collection-errors tests/
  run test_cuda_kernels_nodevice 90 "$PY" -m pytest -q -m "not cuda" tests/cuda/test_cuda_kernels.py
}

do_bench() {
  ensure_built || return
  local f name extra
  for f in benchmarks/cuda/cuda_*.py; do
    [ -e "$f" ] || continue
    name=$(basename "$f" .py)
    extra=()
    if "$PY" "$f" --help 2>/dev/null | grep -q -- "--json"; then
      extra=(--json "$OUT/$name.json")
    fi
    run "bench_$name" "$BENCH_TIMEOUT" "$PY" "$f" "${extra[@]}"
  done
  cp docs/benchmarks.md "$OUT/benchmarks.md" && echo "== copied docs/benchmarks.md to $OUT"
}

do_sanitize() {
  ensure_built || return
  local cs
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  if [ -z "$cs" ]; then
    echo "== compute-sanitizer not found"
    record sanitize 127
    return
  fi
  run sanitize "$BENCH_TIMEOUT" "$cs" --tool memcheck --error-exitcode 99 "$PY" -m pytest -q -m cuda \
    tests/cuda/test_cuda_kernels.py -k "test_copy or float32-sum or bfloat16-max or int8-prod or side_stream"
}

for s in "${steps[@]}"; do
  "do_$s"
done

echo "== summary (step=exit code)"
failed=0
for r in "${results[@]}"; do
  echo "  $r"
  [ "${r##*=}" = 0 ] || failed=1
done
exit "$failed"
