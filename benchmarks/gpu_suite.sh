#!/usr/bin/env bash
# Engine benchmarks on one GPU, randomly initialised models of real sizes (no model hub needed).
# Usage: OUT=some/folder bash benchmarks/gpu_suite.sh   (writes one JSON per benchmark into $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)" | tee -a "$OUT/gpu.txt"
run() { local name=$1; shift; echo "== $name: $*"; timeout 240 python3 "$@" --json > "$OUT/$name.json" 2> "$OUT/$name.err"; echo "rc=$?"; cat "$OUT/$name.json"; tail -3 "$OUT/$name.err"; }
run measure_qwen2.5-0.5b_bf16_N4096 benchmarks/measure_throughput.py --random-config qwen2.5-0.5b --device cuda --dtype bfloat16 --reference-context 4096 --targets 64 --naive-targets 4
run measure_llama-3.2-1b_bf16_N4096 benchmarks/measure_throughput.py --random-config llama-3.2-1b --device cuda --dtype bfloat16 --reference-context 4096 --targets 64 --naive-targets 4
run measure_qwen2.5-0.5b_fp32_N1024 benchmarks/measure_throughput.py --random-config qwen2.5-0.5b --device cuda --dtype float32 --reference-context 1024 --targets 64 --naive-targets 8
run policies_refsize_cuda benchmarks/policies_throughput.py --device cuda --length 512 --sequences 8
# Block protocol (--protocol block) at long reference contexts: forward tokens/s, attention kernel, MFU (bfloat16 peak 989 TFLOP/s)
run block_qwen2.5-0.5b_bf16_N8192 benchmarks/block_throughput.py --random-config qwen2.5-0.5b --device cuda --dtype bfloat16 --reference-context 8192 --blocks 8
run block_llama-3.2-1b_bf16_N8192 benchmarks/block_throughput.py --random-config llama-3.2-1b --device cuda --dtype bfloat16 --reference-context 8192 --blocks 8
run block_qwen2.5-0.5b_bf16_N32768 benchmarks/block_throughput.py --random-config qwen2.5-0.5b --device cuda --dtype bfloat16 --reference-context 32768 --blocks 2
run block_llama-3.2-1b_bf16_N32768 benchmarks/block_throughput.py --random-config llama-3.2-1b --device cuda --dtype bfloat16 --reference-context 32768 --blocks 2
# Streaming memory: attention from eviction steps (FlexAttention on CUDA) vs a dense T x T mask, T up to 64k
echo "== streaming_memory"; timeout 300 python3 benchmarks/streaming_memory.py --device cuda --lengths 1024 4096 16384 65536 > "$OUT/streaming_memory.txt" 2>&1; echo "rc=$?"; cat "$OUT/streaming_memory.txt"
# Peak memory per semantics x policy (prefill_evict: attention scores in blocks of query rows, no T x T matrix), N = 8k, 32k
echo "== memory_scaling"; timeout 900 python3 benchmarks/memory_scaling.py --device cuda --config 0.5b --dtype bfloat16 --lengths 8192 32768 --fit-from 8192 > "$OUT/memory_scaling.txt" 2>&1; echo "rc=$?"; cat "$OUT/memory_scaling.txt"
