#!/usr/bin/env bash
# Every GPU check in one call, for a lent GPU machine as it is: no pip, no
# network, `python3` with torch + triton, the repo on PYTHONPATH. Stages run
# in order of value, each under its own timeout; results are written row by
# row under $OUT (default docs/benchmarks/gpu), so a crash or a timeout keeps
# everything measured before it. See docs/benchmarks/gpu/README.md.
#
#   0 env         gpu_env.txt            nvidia-smi, versions, SMs, L2, clocks
#   1 tests       gpu_kernel_tests.txt   kernel tests compiled for the GPU
#   2 meta        kernel_meta.jsonl      n_regs / n_spills / shared per variant
#   3 gemm        kernels_gpu.{jsonl,md} W4A8 vs cuBLAS INT8 vs FP16, 8B shapes
#   4 attention   kernels_gpu.{jsonl,md} KV4 vs fp16 paged vs SDPA, B x ctx
#   5 smoke       engine_smoke.json      engine on Triton (CUDA) vs torch (CPU)
#   6 throughput  e2e.json               bench throughput, synthetic 8B
# Stage summary: gpu_check.md and gpu_check_stages.jsonl. Exit status: 2 if
# there is no GPU (after stage 0), 1 if any stage failed, else 0.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$root/docs/benchmarks/gpu}"
mkdir -p "$out"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
PY="${PYTHON:-python3}"
budget="${GPU_CHECK_BUDGET_S:-540}"   # the whole run; the last stage gets what is left
t_start=$(date +%s)
failed=0
printf '| stage | exit | seconds | cap | output |\n| --- | --- | --- | --- | --- |\n' > "$out/gpu_check.md"
: > "$out/gpu_check_stages.jsonl"

# stage NAME CAP_S LOGFILE CMD...: run CMD under timeout, tee its output, record the result
stage() {
    local name=$1 cap=$2 log=$3
    shift 3
    local t0 rc
    t0=$(date +%s)
    echo "=== stage $name (cap ${cap}s) ==="
    timeout -k 10 "$cap" "$@" 2>&1 | tee "$out/$log"
    rc=${PIPESTATUS[0]}
    local dt=$(( $(date +%s) - t0 ))
    [ "$rc" = 124 ] && echo "=== stage $name: TIMEOUT after ${cap}s ===" | tee -a "$out/$log"
    echo "| $name | $rc | $dt | $cap | $log |" >> "$out/gpu_check.md"
    printf '{"stage": "%s", "exit": %d, "seconds": %d, "cap": %d, "log": "%s"}\n' \
        "$name" "$rc" "$dt" "$cap" "$log" >> "$out/gpu_check_stages.jsonl"
    [ "$rc" = 0 ] || failed=1
    return 0
}

# ---- 0: env (and the go / no-go) ------------------------------------------
{
    echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ), git $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo "python: $(command -v "$PY" || echo "$PY not found")"
    if command -v nvidia-smi > /dev/null; then
        timeout 10 nvidia-smi || true
        timeout 10 nvidia-smi -q -d CLOCK 2>/dev/null | grep -E -A4 "^ *(Clocks|Max Clocks)" || true
    else
        echo "nvidia-smi: not found"
    fi
} > "$out/gpu_env.txt" 2>&1
timeout 60 "$PY" - >> "$out/gpu_env.txt" 2>&1 <<'EOF'
import sys
print("python", sys.version.split()[0])
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
try:
    import triton
    print("triton", triton.__version__)
except ImportError as e:
    print("triton: not importable:", e)
if not torch.cuda.is_available():
    print("gpu_check: no CUDA device (torch.cuda.is_available() is False): nothing to check on this "
          "machine; run it where a GPU is lent (docs/benchmarks/gpu/README.md)")
    sys.exit(2)
p = torch.cuda.get_device_properties(0)
print(f"device {p.name}, cc {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
      f"L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB, {p.total_memory / 2**30:.1f} GiB")
EOF
rc=$?
cat "$out/gpu_env.txt"
echo "| env | $rc | $(( $(date +%s) - t_start )) | 60 | gpu_env.txt |" >> "$out/gpu_check.md"
if [ "$rc" != 0 ]; then
    grep -q "no CUDA device" "$out/gpu_env.txt" || echo "gpu_check: no CUDA device usable (env stage exit $rc)"
    exit 2
fi

# ---- 1..6 ------------------------------------------------------------------
QOQSERVE_TEST_DEVICE=cuda stage tests 150 gpu_kernel_tests.txt \
    "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_triton_attention.py tests/test_triton_ops.py \
    -k "not engine" --durations=5
stage meta 40 kernel_meta.txt "$PY" scripts/gpu_kernel_meta.py "$out/kernel_meta.jsonl"
stage gemm 150 bench_gemm.txt "$PY" -m qoqserve.cli.main bench kernels --only gemm --out-dir "$out"
stage attention 90 bench_attention.txt "$PY" -m qoqserve.cli.main bench kernels --only attention --out-dir "$out"
stage smoke 120 engine_smoke.txt "$PY" scripts/gpu_engine_smoke.py --device cuda --out "$out/engine_smoke.json"
left=$(( budget - ($(date +%s) - t_start) ))
[ "$left" -lt 30 ] && left=30
stage throughput "$left" e2e.txt "$PY" -m qoqserve.cli.main bench throughput --device cuda \
    --model synthetic:llama-3-8b --precisions w4a8kv4 fp16 --input-len 128 --output-len 32 \
    --max-batch 64 --json-out "$out/e2e.json"

echo "=== done in $(( $(date +%s) - t_start )) s; summary: $out/gpu_check.md ==="
cat "$out/gpu_check.md"
exit "$failed"
