#!/usr/bin/env bash
# The one prepared script for a lent GPU machine (H200, Python 3.12, its own torch, no network).
#
# Before the call, on the dev machine (once): carry the `nvtx` wheel, which the GPU image lacks:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl nvtx
# Then: device run with carry [".whl"], command `bash profiling/gpu_check.sh`, timeout_s ~540.
# It installs the project without dependencies, runs the cuda-marked tests, a short GPU bench of the decode step
# (graph replay vs eager, first step vs median, MHA and MLA), the model bench, and an nsys session when nsys
# exists; logs go to $OUT (or ./gpu_check_out). Every stage has its own timeout; the whole fits in 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_check_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }

if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { echo "pip install -e . failed; using PYTHONPATH" >>"$OUT/install.log"; export PYTHONPATH="$PWD:${PYTHONPATH:-}"; }
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee -a "$OUT/summary.txt"

log "cuda tests"
timeout 240 python3 -m pytest -m cuda -q -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest_cuda.log" | tail -15

log "decode step, 4 layers, graph replay vs eager"
for model in mha mla; do
    timeout 90 python3 -m compiled_attn.bench.step --device cuda --model "$model" --layers 4 --batch-size 1 8 32 \
        --cuda-graph-bs 1 8 32 --iters 20 --quiet --json "$OUT/step_$model.json" 2>&1 | tee -a "$OUT/summary.txt" | tail -8
done

log "model bench"
timeout 150 python3 -m compiled_attn.bench.latency --device cuda --model llama-3-8b --layers 2 --batch-size 1 8 32 \
    --input-len 512 --output-len 8 --cuda-graph-bs 1 8 32 --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -20

if command -v nsys >/dev/null 2>&1; then
    log "nsys session"
    OUT="$OUT/nsys" timeout 120 bash profiling/nsys_session.sh --model tiny-llama --batch-size 8 --output-len 4 \
        --backend compiled --device cuda 2>&1 | tail -30 | tee -a "$OUT/summary.txt"
else
    log "nsys not on PATH: torch.profiler summary instead"
    timeout 90 python3 -m compiled_attn.bench.latency --device cuda --model tiny-llama --batch-size 8 --output-len 4 \
        --backend compiled --enable-nvtx --profile torch --trace "$OUT/trace.json" >/dev/null 2>&1 \
        && python3 -m profiling.summary "$OUT/trace.json" 2>&1 | head -30 | tee -a "$OUT/summary.txt"
fi
log "done"
