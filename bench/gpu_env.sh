# Sourced by the GPU bench scripts: the GPU machine's environment (the bundle's site on
# PYTHONPATH, its py-spy, NCCL without NVLink multicast: see the device notes), $OUT, $PY, log().
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=/opt/gpu-boot${PYTHONPATH:+:$PYTHONPATH}
export PATH=/opt/gpu-site/bin:$PATH
export TRAINDX_PYSPY=${TRAINDX_PYSPY:-/opt/gpu-site/bin/py-spy}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
PY=${PY:-python3}
log() { echo "== $(date +%T) $*"; }
