#!/usr/bin/env bash
# The trainer bench on a GPU: a random Qwen2.5-0.5B-shaped model, bf16 autocast, 4 batches
# (the first a warm-up). Run from the repo root with .venv present; the last stdout line is
# the JSON. Progress goes to stderr; set PEAK_TFLOPS for a GPU other than H100/H200.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >&2
.venv/bin/python -c 'import torch; assert torch.cuda.is_available(), "no CUDA in .venv torch"'
exec .venv/bin/harnessrl bench trainer --json --model-size 0.5b --batches 4 \
  --peak-tflops "${PEAK_TFLOPS:-989}" "$@"
