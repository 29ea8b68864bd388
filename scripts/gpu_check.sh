#!/usr/bin/env bash
# The prepared GPU check: one short command on a machine with one NVIDIA GPU, under 8 minutes, one line per
# check (PASS/FAIL/SKIP with the reason), full logs under $OUT (or /tmp/gpu_check).
#
#   bash scripts/gpu_check.sh            # from the repository root
#
# Where trl, deepspeed, wandb, datasets or math-verify are missing (the lent GPU image lacks them and has no
# network), put their wheels in .whl/ first (scripts/gpu_wheels.sh downloads them here) and carry .whl:
# they are installed with --no-deps into /tmp/site. bubblewrap: a .deb in .whl/ is unpacked onto PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${OUT:-/tmp/gpu_check}; mkdir -p "$LOG"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1 && ! $PY -c "import trl, deepspeed" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >"$LOG/wheels.log" 2>&1
  export PYTHONPATH="$PYTHONPATH:/tmp/site" PATH="/tmp/site/bin:$PATH"
fi
if ls .whl/*.deb >/dev/null 2>&1 && ! command -v bwrap >/dev/null; then
  for f in .whl/*.deb; do dpkg -x "$f" /tmp/debs; done; export PATH="/tmp/debs/usr/bin:$PATH"
fi
START=$(date +%s); FAILED=0
check() {  # check NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$LOG/$name.log" 2>&1; local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  if [ $rc -eq 0 ]; then echo "PASS  $name  (${dt}s) $(grep -h '^RESULT' "$LOG/$name.log" | tail -1)";
  elif [ $rc -eq 77 ]; then echo "SKIP  $name  $(tail -1 "$LOG/$name.log")";
  else FAILED=1; echo "FAIL  $name  (rc=$rc, ${dt}s): $(grep -v '^\s*$' "$LOG/$name.log" | tail -3 | tr '\n' ' ' | cut -c1-300)"; fi
}
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('GPU', torch.cuda.get_device_name(0), 'torch', torch.__version__)" || exit 1

# -o addopts: the GPU image may lack pytest-xdist, which the suite's addopts (-n auto) need.
check gpu-tests 150 $PY -m pytest -q -m gpu -p no:cacheprovider -o addopts=-ra tests/
check recipe-single-gpu-bf16 150 accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/retool_ppo.py \
  --max_steps 4 --eval_problems 16 --output_dir /tmp/gc-recipe --bf16 true
check zero3-one-gpu 120 accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 1 recipes/retool_ppo.py \
  --max_steps 2 --eval_problems 0 --output_dir /tmp/gc-zero3 --bf16 true
check lora-one-gpu 120 accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/retool_ppo.py \
  --max_steps 2 --eval_problems 0 --output_dir /tmp/gc-lora --bf16 true --use_peft --lora_r 8
check cb-one-gpu 150 accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/retool_ppo.py \
  --max_steps 2 --eval_problems 0 --output_dir /tmp/gc-cb --bf16 true --use_transformers_continuous_batching true \
  --continuous_batching_keep_cache true
if $PY -c "import vllm" 2>/dev/null; then
  check vllm-colocate 180 accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/retool_ppo.py \
    --max_steps 2 --eval_problems 0 --output_dir /tmp/gc-vllm --bf16 true --use_vllm true --vllm_mode colocate \
    --vllm_gpu_memory_utilization 0.3
else
  echo "SKIP  vllm-colocate  vLLM is not importable here"
fi
check generation-0.36b 150 $PY benchmarks/generation.py --shape qwen2-0.36b --dtype bfloat16 --prompts 64 --tokens 256
grep -A5 '^backend' "$LOG/generation-0.36b.log" | sed 's/^/      /'
# The update at long lengths on the GPU (docs/benchmarks.md has the CPU figures): peak GPU memory, full logits vs chunks.
check long-context-gpu 120 $PY benchmarks/long_context.py --device cuda --lengths 4096 8192 16384 32768 --today-max 8192
grep -E '^ *[0-9]+ |chunked / today' "$LOG/long-context-gpu.log" | sed 's/^/      /'
echo "total $(( $(date +%s) - START ))s"
exit $FAILED
