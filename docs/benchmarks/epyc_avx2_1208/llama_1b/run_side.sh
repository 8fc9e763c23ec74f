#!/bin/bash
# llama.cpp (AVX2 build) vs ours on a Llama-3.2-1B-shaped model, two rounds, one after another
cd /work/main
B=/tmp/peers/llama-build/bin
D=docs/benchmarks/xeon_amx/llama_1b_1207
[ -f /tmp/peers/l1b-f16.gguf ] || .venv/bin/python $D/write_gguf.py /tmp/peers/l1b-f16.gguf
[ -f /tmp/peers/l1b-q4_0.gguf ] || $B/llama-quantize /tmp/peers/l1b-f16.gguf /tmp/peers/l1b-q4_0.gguf Q4_0 > /dev/null 2>&1
for r in 1 2; do
  echo "## round $r (load average $(cut -d' ' -f1 /proc/loadavg))"
  $B/llama-bench -m /tmp/peers/l1b-q4_0.gguf -p 512 -n 128 -r 3 -t 2 2>/dev/null | grep -E "pp512|tg128"
  .venv/bin/python $D/ours.py synthetic:llama-3.2-1b:qoq-g64 2>&1 | grep -v Warn
done
