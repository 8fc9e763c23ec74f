#!/usr/bin/env bash
# Every GPU check in one call (for a lent GPU machine; see docs/kernels.md):
#  1. the kernel tests compiled for the GPU instead of interpreted,
#  2. the kernel benchmark on Llama-3-8B shapes.
# Results go to ${OUT:-docs/benchmarks}. Uses the python on PATH, which must
# have a CUDA build of torch (and triton, which comes with it).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$root/docs/benchmarks}"
mkdir -p "$out"
cd "$root"
python -c "import torch, triton; assert torch.cuda.is_available(); print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$out/gpu_env.txt" || exit 1
python -m pip install -q --no-deps -e . 2>&1 | tail -1
python -m pip install -q pytest safetensors tokenizers gguf jinja2 tqdm 2>&1 | tail -1
QOQSERVE_TEST_DEVICE=cuda TRITON_INTERPRET=0 python -m pytest -q tests/test_triton_kernels.py 2>&1 | tee "$out/gpu_kernel_tests.txt"
python -m qoqserve.cli.main bench kernels --json-out "$out/kernels_gpu.json" 2>&1 | tee "$out/kernels_gpu.md"
