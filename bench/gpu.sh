#!/usr/bin/env bash
# One prepared GPU check (fits in 8 minutes on one H100/H200): the CUDA paths (Triton kernels vs
# their references, NCCL, flash-attn's presence), Qwen3-8B-shaped pass costs and the projected
# speedup; the table is printed last and the JSON goes to $OUT (or out/bench).
#   bash bench/gpu.sh            on a GPU machine with torch (CUDA), triton and this checkout
#   bash bench/gpu.sh --device cpu --tiny   the same steps, tiny, on the CPU (checks the script)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export OUT="${OUT:-out/bench}"
if [[ " $* " == *" --device cpu "* ]]; then export TRITON_INTERPRET=1; fi
# Dependencies the GPU image may lack (pure Python; no network needed when already present).
"$PYTHON" -c "import simpy, safetensors, tokenizers" 2>/dev/null || "$PYTHON" -m pip install -q simpy safetensors tokenizers
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
PYTHONPATH=. timeout 470 "$PYTHON" -m specd.cli bench gpu --out "$OUT" "$@"
