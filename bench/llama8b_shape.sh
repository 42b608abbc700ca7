#!/usr/bin/env bash
# Decode throughput at the Llama-3-8B shape with random weights (no download): plain at batch
# 1 / 16 / 64, then a random EAGLE3 head (32k draft vocabulary) drafting a 3-step chain whose
# acceptance is forced to 3 tokens, the workloads of the vLLM comparison in
# docs/PERFORMANCE.md (512-token prompts, 256 new tokens, greedy, bf16).
#   bash bench/llama8b_shape.sh [more `specserve bench one-batch` flags]   # CUDA machine
set -uo pipefail
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
DRAFT=${DRAFT:-/tmp/eagle3-8b-random}
git rev-parse --short HEAD 2>/dev/null
if [ ! -e "$DRAFT/config.json" ]; then
  $PY - "$DRAFT" <<'PY'
import sys
from specserve.model.config import PRESETS
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
write_random_eagle_checkpoint(sys.argv[1], PRESETS["llama3-8b"], "EAGLE3", draft_vocab_size=32000)
PY
fi
BASE=(--model-path llama3-8b --load-format dummy --batch-size 1 16 64 --input-len 512 --output-len 256)
echo "== plain"
$PY -m specserve.cli bench one-batch "${BASE[@]}" "$@"
echo "== EAGLE3 chain of 3, accept length forced to 3"
$PY -m specserve.cli bench one-batch "${BASE[@]}" --speculative-algorithm EAGLE3 \
  --speculative-draft-model-path "$DRAFT" --speculative-num-steps 3 --speculative-eagle-topk 1 \
  --speculative-num-draft-tokens 4 --simulate-acc-len 3 --simulate-acc-method match-expected "$@"
