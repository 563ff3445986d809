#!/usr/bin/env bash
# Profile `compiled-attn bench` under Nsight Systems and print our range summary.
#
# Usage:
#   profiling/nsys_session.sh [bench args...]
#   OUT=/tmp/prof profiling/nsys_session.sh --backend compiled --batch-size 1 8 64
#
# Steps:
#   1. nsys profile --trace=cuda,nvtx,osrt --cuda-graph-trace=node -o $OUT/bench --force-overwrite true \
#        compiled-attn bench <args> --enable-nvtx
#      (--cuda-graph-trace=node shows the kernels inside replayed CUDA graphs; our NVTX ranges are Python-side
#       and sit around capture/replay, they are not replayed inside a graph.)
#   2. nsys stats --report nvtx_sum,cuda_gpu_kern_sum --format csv --output $OUT/bench
#      -> $OUT/bench_nvtx_sum.csv, $OUT/bench_cuda_gpu_kern_sum.csv
#      (falls back to the pre-2023 report names nvtxppsum,gpukernsum if the new names are rejected)
#   3. python -m profiling.summary $OUT/bench_nvtx_sum.csv
#
# Environment: OUT (output dir, default ./nsys_out), PYTHON (default python), BENCH (default compiled-attn).
# Exit status: 3 if nsys is not on PATH, 4 if the bench command is missing, else that of the failing step.

if ! command -v nsys >/dev/null 2>&1; then
    echo "nsys not found on PATH: install Nsight Systems (https://developer.nvidia.com/nsight-systems) and add its bin/ directory (nsys) to PATH" >&2
    exit 3
fi

set -euo pipefail

out_dir="${OUT:-./nsys_out}"
python_bin="${PYTHON:-python}"
bench="${BENCH:-compiled-attn}"
prefix="${out_dir}/bench"

if ! command -v "${bench}" >/dev/null 2>&1; then
    echo "${bench} not found on PATH: pip install -e . (or set BENCH to the bench command)" >&2
    exit 4
fi

mkdir -p "${out_dir}"

echo "== nsys profile -> ${prefix}.nsys-rep" >&2
nsys profile --trace=cuda,nvtx,osrt --cuda-graph-trace=node -o "${prefix}" --force-overwrite true \
    "${bench}" bench "$@" --enable-nvtx

report="${prefix}.nsys-rep"
[[ -f "${report}" ]] || report="${prefix}.qdrep"   # nsys < 2021.4

echo "== nsys stats -> ${prefix}_*.csv" >&2
nvtx_csv="${prefix}_nvtx_sum.csv"
if ! nsys stats --report nvtx_sum,cuda_gpu_kern_sum --format csv --output "${prefix}" --force-export=true "${report}"; then
    echo "nsys stats rejected nvtx_sum/cuda_gpu_kern_sum; retrying with the older report names" >&2
    nsys stats --report nvtxppsum,gpukernsum --format csv --output "${prefix}" --force-export=true "${report}"
    nvtx_csv="${prefix}_nvtxppsum.csv"
fi

echo "== range summary (${nvtx_csv})" >&2
"${python_bin}" -m profiling.summary "${nvtx_csv}"
