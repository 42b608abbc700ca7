#!/usr/bin/env bash
# Everything issue 6 measures, in one device call (~6 min on an H200; see docs/PERFORMANCE.md):
# the GPU tests, the one-batch rows of the goal table, and `bench compare` (this engine plain,
# EAGLE3 at simulated accept lengths, overlap on/off, HF transformers' static cache) in one run.
# Usage (repo root, CUDA machine whose python3 has torch/triton/transformers):
#   OUT=/tmp/out bash bench/gpu_session.sh
set -uo pipefail
OUT=${OUT:-/tmp/specserve-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/device.txt"

echo "== GPU tests $(date +%T)" | tee "$OUT/tests.log"
timeout 300 $PY -m pytest -q -p no:cacheprovider -m "not slow" tests/test_gpu.py tests/test_triton_attention.py \
  tests/test_triton_norm.py tests/test_triton_rope.py tests/test_triton_linear.py tests/test_triton_engine.py \
  2>&1 | tail -6 | tee -a "$OUT/tests.log"

row() {  # name, then `specserve bench one-batch` flags; prints batch, decode tok/s, ms/token
  local name=$1; shift
  echo "== $name $(date +%T)" | tee -a "$OUT/bench.log"
  timeout 150 $PY -m specserve.cli bench one-batch --input-len 128 --output-len 256 "$@" > "$OUT/last.log" 2>&1
  grep -A3 "^batch_size" "$OUT/last.log" | grep -v "^---" | cut -d'|' -f1,7,8 | tee -a "$OUT/bench.log"
}
$PY - <<'PY'
from specserve.model.config import PRESETS
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
write_random_eagle_checkpoint("/tmp/eagle3-8b", PRESETS["llama3-8b"], "EAGLE3", draft_vocab_size=32000)
PY
row "8B plain" --model-path llama3-8b --load-format dummy --batch-size 1 16
row "135M plain" --model-path smollm2-135m --load-format dummy --batch-size 1 128
SPEC="--model-path llama3-8b --load-format dummy --speculative-algorithm EAGLE3 --speculative-draft-model-path /tmp/eagle3-8b --batch-size 1 --simulate-acc-method match-expected"
row "8B EAGLE3 chain acc3" $SPEC --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --simulate-acc-len 3
row "8B EAGLE3 tree acc3" $SPEC --speculative-num-steps 4 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16 --simulate-acc-len 3
row "8B EAGLE3 chain acc1" $SPEC --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --simulate-acc-len 1

echo "== compare $(date +%T)" | tee -a "$OUT/bench.log"
timeout 240 $PY -m specserve.cli bench compare --model-path llama3-8b --load-format dummy --batch-size 1 \
  --accept-lengths 1 2 3 --output-json "$OUT/compare.json" --plot "$OUT/compare.png" > "$OUT/compare.log" 2>&1
tail -9 "$OUT/compare.log" | tee -a "$OUT/bench.log"
