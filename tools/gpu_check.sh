#!/usr/bin/env bash
# The project's CUDA checks in one run (docs/gpu-check.md): the CUDA tests and the numerics tests, Big-Layers and
# exact accumulation measured on the GPU, the loader, a bf16 accumulated ViT step, a one-epoch demo on CUDA.
#
#   bash tools/gpu_check.sh            # on a machine with a CUDA GPU; logs into $OUT (default gpu_check_out/)
#   bash tools/gpu_check.sh --dry-run  # on a CPU: the same steps with CPU sizes, to check the script before a GPU run
#   STEPS="numerics demo" bash tools/gpu_check.sh   # only the named steps (a rerun); SIDES="...", BIGL_ARGS="..." for bench_bigl
#
# On a GPU machine whose Python lacks this project's dependencies, put their wheels in .whl/ (docs/gpu-check.md says
# which); they are installed into /tmp/site first. Every step has its own time limit, so one slow or failing step
# cannot take the others' time; the summary at the end gives each step's exit status and seconds.
set -u
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
PY=${PY:-python3}
[ $DRY = 1 ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
SUMMARY=()

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log to $OUT/NAME.log, record rc and seconds
    local name=$1 limit=$2; shift 2
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi  # STEPS="a b": only those steps
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 60 "$OUT/$name.log"
    SUMMARY+=("$name: rc $rc, $((SECONDS - t0)) s")
    echo "=== $name: rc $rc in $((SECONDS - t0)) s"
}

if [ $DRY = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the repository first, then the wheels
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null || echo "no nvidia-smi"
    $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
'available', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'); print('cores', __import__('os').cpu_count())"
    $PY -c "import wsi_pipeline, zarr, tiffslide, openslide, kornia; print('imports ok: zarr', zarr.__version__)"
} 2>&1 | tee "$OUT/summary.txt"

if [ $DRY = 1 ]; then
    export WSI_CUDA_TEST_DEVICE=cpu  # tests/training/test_cuda_float64.py runs its comparisons on the CPU
    DEV=cpu; SIDES="96 128"; BAGS="8 16"; TILE=32; CHUNK=4; LIMIT_SHORT=60
else
    DEV=cuda; SIDES=${SIDES:-2048 4096 8192}; BAGS="64 256 1024"; TILE=256; CHUNK=64; LIMIT_SHORT=0
fi
lim() { [ "$LIMIT_SHORT" -gt 0 ] && echo "$LIMIT_SHORT" || echo "$1"; }

# 1. the CUDA tests (skipped without a GPU) and the numerics tests, fast ones, on this machine's torch
step cuda_tests "$(lim 90)" $PY -m pytest -q -s -rA -p no:cacheprovider tests/training/test_cuda_float64.py \
    tests/training/test_accumulate_rng.py "tests/bigl/test_bigl.py::test_cuda_bigified_equals_plain" \
    "tests/bigl/test_bigl.py::test_cuda_pointwise_on_device_equals_plain" \
    "tests/bigl/test_bigl.py::test_cuda_peak_memory_does_not_grow_with_input"
NUMERICS=$($PY -c "import sys; sys.path[:0]=['tests']; from project.test_instruction_sets import NUMERICS_TESTS as N; print(' '.join(N))")
XDIST=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n 8 -p no:benchmark"  # pytest-benchmark, where installed, refuses xdist
step numerics "$(lim 90)" $PY -m pytest -q -p no:cacheprovider $XDIST -m "not slow" $NUMERICS \
    --deselect tests/training/test_accumulate.py::test_saved_activation_memory_does_not_grow_with_the_bag

# 2. Big-Layers measured (the predicted tables are counts: run them on any machine, --no-timing) and accumulation
step bench_bigl "$(lim 100)" $PY -m benchmarks.bigl --quick --no-predict --device $DEV --sides $SIDES ${BIGL_ARGS:-}
step bench_accumulate "$(lim 60)" $PY -m benchmarks.accumulate --device $DEV --bags $BAGS --tile-size $TILE --chunk-size $CHUNK

# 3. the loader, one accumulated ViT step in bf16 (two presets), a one-epoch demo on the device
SLIDE=.gpu/CMU-1-Small-Region.svs
[ -f $SLIDE ] || SLIDE=../shared/slides/CMU-1-Small-Region.svs
step bench_loader "$(lim 45)" $PY -m benchmarks.loader --slide $SLIDE
step encoders_gpu "$(lim 60)" $PY -m benchmarks.encoders_gpu --presets uni_v1 virchow2 --bag 256 --chunk 32
step demo "$(lim 90)" $PY -m wsi_pipeline.cli.main demo --device $DEV --internal 12 --external 4 \
    --set train.epochs=1 --set train.bf16=true --no-progress

echo
echo "summary:"
{
    printf '  %s\n' "${SUMMARY[@]}"
    grep -h "CUDA-EXACT" "$OUT/cuda_tests.log" 2>/dev/null | sort -u
} | tee -a "$OUT/summary.txt"
