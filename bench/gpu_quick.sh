#!/usr/bin/env bash
# A short GPU check: the CUDA tests, then decode speed at the issue-6 shapes (one-batch).
# Usage (repo root, CUDA machine): OUT=/tmp/out bash bench/gpu_quick.sh [extra pytest files]
set -uo pipefail
OUT=${OUT:-/tmp/specserve-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/device.txt"
echo "== GPU tests $(date +%T)"
timeout ${TEST_TIMEOUT:-240} $PY -m pytest -q -x -p no:cacheprovider tests/test_gpu.py "$@" 2>&1 | tail -30 | tee "$OUT/tests.log"
bench() {  # name, then specserve bench one-batch flags
  local name=$1; shift
  echo "== $name $(date +%T)" | tee -a "$OUT/bench.log"
  timeout ${BENCH_TIMEOUT:-120} $PY -m specserve.cli bench one-batch --input-len 128 --output-len 256 "$@" 2>&1 | tail -4 | tee -a "$OUT/bench.log"
}
$PY - <<'PY'
from specserve.model.config import PRESETS
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
write_random_eagle_checkpoint("/tmp/eagle3-8b", PRESETS["llama3-8b"], "EAGLE3", draft_vocab_size=32000)
PY
bench "8B plain" --model-path llama3-8b --load-format dummy --batch-size 1 16
bench "135M plain" --model-path smollm2-135m --load-format dummy --batch-size 1 128
SPEC="--model-path llama3-8b --load-format dummy --speculative-algorithm EAGLE3 --speculative-draft-model-path /tmp/eagle3-8b --batch-size 1"
bench "8B EAGLE3 chain acc3" $SPEC --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --simulate-acc-len 3 --simulate-acc-method match-expected
bench "8B EAGLE3 tree acc3" $SPEC --speculative-num-steps 4 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16 --simulate-acc-len 3 --simulate-acc-method match-expected
bench "8B EAGLE3 chain acc1" $SPEC --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --simulate-acc-len 1 --simulate-acc-method match-expected
