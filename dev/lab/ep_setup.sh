# Sourced by dev/lab/ep_profile.sh and ep_run.sh on a GPU machine: the environment (NVLink
# multicast off), the carried wheels (.whl/) on PYTHONPATH, samoyeds built for sm_90a; $OUT.
export PYTHONUNBUFFERED=1 SAMOYEDS_CUDA_ARCHS=90a SAMOYEDS_BUILD_JOBS=${SAMOYEDS_BUILD_JOBS:-32} NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
t0=$(date +%s)
python3 -m pip install -q --no-build-isolation -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
# the warnings transformers and torch.distributed repeat on every rank, out of the log
quiet() { grep --line-buffered -v "Warning\|warn(\|_warn_once\|USDT\|output = func\|^\*\*\*\|OMP_NUM_THREADS\|^$\|match nothing"; }
