#!/usr/bin/env bash
# The one prepared check for a lent GPU machine (H100/H200, its own torch, no network, no SGLang, no nsys unless the
# image has it). Whole run under 8 minutes: every stage has its own limit (below), and says why it skipped if it does.
#
# Before the call, on the dev machine (once): carry the `nvtx` wheel (NVTX ranges for nsys), which the image lacks:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl nvtx      (.whl/ is git-ignored)
# Then: device run with carry [".whl"], command `bash profiling/gpu_check.sh`, timeout_s ~540.
#
# Stages (limits in s; 455 in all): versions; carried wheels (20); install (30); pytest -m cuda (120);
# tests/test_triton_kernels.py (35); tests/test_sglang_graph_order.py, its CPU twins and the timing script's smoke (45);
# the timing script, compiled_attn.bench.gpu_decode (140); a short profiled timing run under nsys (35, stats 20), or
# torch.profiler without nsys (35); the range summary (10).
# Outputs (logs, JSON, traces) go to ${OUT:-./gpu_check_out}; each stage's log tail is printed too.
#
# Dry mode (GPU_CHECK_DRY=1, or no CUDA device): prints the plan, installs nothing, and runs the parts a CPU can:
# the graph-order tests (their CPU twins), the timing script's CPU smoke run and its torch.profiler summary.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_check_out}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
skip() { local what=$1; shift; say "-- skipped: $what: $*"; }

# stage NAME LIMIT LOG CMD...: run CMD under LIMIT seconds, its whole output in LOG, its last 25 lines here
stage() {
    local name=$1 limit=$2 log=$3
    shift 3
    say "== $name (limit ${limit}s; log $log)"
    say "   \$ $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"$log" 2>&1
    local rc=$?
    tail -n 25 "$log"
    case $rc in
        0) say "   ok ($((SECONDS - start))s)" ;;
        124) say "   TIMED OUT after ${limit}s (partial output in $log)" ;;
        *) say "   FAILED: exit status $rc ($((SECONDS - start))s; $log)" ;;
    esac
    return 0
}

CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>"$OUT/torch_import.log")
CUDA=${CUDA:-0}
DRY=${GPU_CHECK_DRY:-0}
if [[ "$CUDA" != 1 ]]; then
    DRY=1
    say "== no CUDA device here: dry run (the plan, and the CPU parts only)"
elif [[ "$DRY" == 1 ]]; then
    say "== GPU_CHECK_DRY=1: dry run (the plan, and the CPU parts only)"
fi

# ---------------------------------------------------------------- versions
say "== device and versions"
"$PY" - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import importlib, os, platform, sys, torch
sys.path.insert(0, os.getcwd())
try:  # SGLang on a CPU torch imports only after this fix-up (it does not import SGLang)
    from compiled_attn.sglang.cpu_fixups import ensure_sglang_importable
    ensure_sglang_importable()
except Exception as e:
    print("compiled_attn not importable:", type(e).__name__, e)
print("python", platform.python_version(), "| torch", torch.__version__, "| torch CUDA", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
else:
    print("device: none (no CUDA)")
for name in ("triton", "pytest", "hypothesis", "nvtx", "sglang"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "(no version)"))
    except Exception as e:  # sglang can fail on more than ImportError on a machine it was not installed for
        print(name, "not importable:", type(e).__name__)
EOF
if command -v nvidia-smi >"$OUT/which.txt" 2>&1; then
    nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
    head -n 12 "$OUT/nvidia-smi.txt"
    say "   nvidia-smi: $OUT/nvidia-smi.txt"
else
    skip "nvidia-smi" "not on PATH"
fi
NSYS=$(command -v nsys || true)
NCU=$(command -v ncu || true)
say "   nsys: ${NSYS:-not on PATH}; ncu: ${NCU:-not on PATH}"

# ---------------------------------------------------------------- carried wheels and the install
WHEELS=(.whl/*.whl)
if [[ -e "${WHEELS[0]}" ]]; then
    if [[ "$DRY" == 1 ]]; then
        skip "carried wheels (${WHEELS[*]})" "dry run: would install them into /tmp/site"
    else
        stage "install the carried wheels: ${WHEELS[*]} -> /tmp/site (PYTHONPATH)" 20 "$OUT/wheels.log" \
            "$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "${WHEELS[@]}"
        export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
    fi
else
    skip "carried wheels" "none in .whl/ (carry .whl with the nvtx wheel for NVTX ranges; see the header)"
fi
if [[ "$DRY" == 1 ]]; then
    skip "pip install -e ." "dry run: the checkout is used as it is"
    export PYTHONPATH="$PWD:${PYTHONPATH:-}"
else
    stage "install the project (no dependencies: the machine's torch stays)" 30 "$OUT/install.log" \
        "$PY" -m pip install --no-deps --no-build-isolation -e .
    "$PY" -c "import compiled_attn" 2>>"$OUT/install.log" || {
        say "   the installed project does not import: using PYTHONPATH=$PWD"
        export PYTHONPATH="$PWD:${PYTHONPATH:-}"
    }
fi
HAVE_NVTX=$("$PY" -c "import nvtx; print(1)" 2>>"$OUT/torch_import.log" || echo 0)
HAVE_SGLANG=$("$PY" -c "import compiled_attn.sglang.testing as H; print(int(H.sglang_available()))" \
    2>>"$OUT/torch_import.log" || echo 0)
[[ "$HAVE_NVTX" == 1 ]] || say "   nvtx not importable: phases are torch.profiler ranges only (no NVTX for nsys)"
if [[ "$HAVE_SGLANG" == 1 ]]; then
    say "   SGLang imports: the graph order runs over SGLang's own types"
else
    say "   SGLang not installed: the graph order runs through the replica's stand-ins (graph_order.py);" \
        "the tests that need SGLang itself skip"
fi

# ---------------------------------------------------------------- tests
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs --disable-warnings)
if [[ "$DRY" == 1 ]]; then
    skip "pytest -m cuda tests" "dry run (would run: ${PYTEST[*]} -m cuda tests)"
    skip "tests/test_triton_kernels.py on the GPU" "dry run (on CPU it runs in Triton's interpreter in the CI suite)"
    stage "graph-order tests, CPU twins and the timing script's smoke" 120 "$OUT/pytest_graph_order.log" \
        "${PYTEST[@]}" tests/test_sglang_graph_order.py
else
    stage "cuda-marked tests" 120 "$OUT/pytest_cuda.log" "${PYTEST[@]}" -m cuda tests
    stage "triton kernels on the GPU" 35 "$OUT/pytest_triton.log" "${PYTEST[@]}" tests/test_triton_kernels.py
    # its cuda twin ran with the cuda-marked tests above
    stage "graph-order tests, CPU twins and the timing script's smoke" 45 "$OUT/pytest_graph_order.log" \
        "${PYTEST[@]}" -m "not cuda" tests/test_sglang_graph_order.py
fi

# ---------------------------------------------------------------- timing
BENCH=("$PY" -m compiled_attn.bench.gpu_decode)
if [[ "$DRY" == 1 ]]; then
    skip "GPU timing" "dry run (would run: ${BENCH[*]} --out $OUT/gpu_decode.json)"
    stage "timing script, CPU smoke configuration" 60 "$OUT/gpu_decode.log" \
        "${BENCH[@]}" --smoke --out "$OUT/gpu_decode_smoke.json"
else
    stage "decode timing: first / step / replay / compiled / eager vs the K/V read; capacity cost" 140 \
        "$OUT/gpu_decode.log" "${BENCH[@]}" --out "$OUT/gpu_decode.json"
    say "   JSON: $OUT/gpu_decode.json (rows written as they finish)"
fi

# ---------------------------------------------------------------- profile
PROFILE_ARGS=(--bs 8 --ctx 8192 --iters 20 --no-compiled --no-capacity)
if [[ "$DRY" == 1 ]]; then
    if [[ -n "$NSYS" ]]; then
        skip "nsys" "dry run (would run nsys profile --cuda-graph-trace=node around ${BENCH[*]} ${PROFILE_ARGS[*]})"
    fi
    stage "torch.profiler around the timing script's smoke run" 60 "$OUT/profile.log" \
        "${BENCH[@]}" --smoke --ctx 64 --bs 2 --no-capacity --out "$OUT/gpu_decode_profiled.json" \
        --torch-profile "$OUT/trace.json"
    stage "range summary of the torch.profiler trace" 30 "$OUT/profile_summary.log" \
        "$PY" -m profiling.summary "$OUT/trace.json"
    say "   trace: $OUT/trace.json"
elif [[ -n "$NSYS" ]]; then
    stage "nsys around a short timing run (bs 8, 8k context)" 35 "$OUT/nsys.log" \
        "$NSYS" profile --trace=cuda,nvtx --cuda-graph-trace=node --force-overwrite true -o "$OUT/gpu_decode" \
        "${BENCH[@]}" "${PROFILE_ARGS[@]}" --nvtx --out "$OUT/gpu_decode_profiled.json"
    REP="$OUT/gpu_decode.nsys-rep"
    [[ -f "$REP" ]] || REP="$OUT/gpu_decode.qdrep"  # nsys < 2021.4
    stage "nsys stats" 20 "$OUT/nsys_stats.log" "$NSYS" stats --report nvtx_sum,cuda_gpu_kern_sum --format csv \
        --output "$OUT/gpu_decode" --force-export=true "$REP"
    if [[ "$HAVE_NVTX" == 1 ]]; then
        stage "range summary (nsys NVTX)" 10 "$OUT/profile_summary.log" \
            "$PY" -m profiling.summary "$OUT/gpu_decode_nvtx_sum.csv"
    else
        skip "NVTX range summary" "nvtx not importable: the trace has kernels but none of our ranges" \
            "(kernel summary: $OUT/gpu_decode_cuda_gpu_kern_sum.csv)"
    fi
    say "   trace: $REP (open in Nsight Systems); CSVs: $OUT/gpu_decode_*.csv"
else
    skip "nsys" "not on PATH: torch.profiler instead"
    stage "torch.profiler around a short timing run (bs 8, 8k context)" 35 "$OUT/profile.log" \
        "${BENCH[@]}" "${PROFILE_ARGS[@]}" --out "$OUT/gpu_decode_profiled.json" --torch-profile "$OUT/trace.json"
    stage "range summary of the torch.profiler trace" 10 "$OUT/profile_summary.log" \
        "$PY" -m profiling.summary "$OUT/trace.json"
    say "   trace: $OUT/trace.json (chrome://tracing or Perfetto)"
fi
if [[ -n "$NCU" ]]; then
    skip "ncu" "not run: replaying each kernel of a graph step takes minutes; run it by hand on one kernel"
fi
say "== done in ${SECONDS}s; summary: $SUMMARY; everything else: $OUT/"
