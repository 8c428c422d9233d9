#!/usr/bin/env bash
# The trainer on one GPU, on a randomly initialised Qwen3-architecture model of about 1.5 B
# parameters built from examples/configs/qwen3-1.5b-shape (no download): first full
# weights, then LoRA adapters on a frozen bf16 base, each against a bare PyTorch loop on
# the same batches (4 batches, the first a warm-up). Prints tokens/s, MFU and peak GPU
# memory per run; the last two stdout lines are the JSON of each. Budget: under 8 minutes
# on one H200 (building and saving the random model twice is most of it). Run from the
# repo root with .venv present; set PEAK_TFLOPS for a GPU other than H100/H200 (bf16 dense).
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >&2
.venv/bin/python -c 'import torch; assert torch.cuda.is_available(), "no CUDA in .venv torch"'
common=(--json --model-config examples/configs/qwen3-1.5b-shape --batches 4 --samples 32
  --min-len 256 --max-len 1024 --micro-batch-tokens 8192 --device cuda
  --peak-tflops "${PEAK_TFLOPS:-989}")
echo "== full weights" >&2
timeout 300 .venv/bin/harnessrl bench trainer "${common[@]}" "$@" | tail -1
echo "== LoRA rank 16" >&2
timeout 240 .venv/bin/harnessrl bench trainer "${common[@]}" --lora "$@" | tail -1
