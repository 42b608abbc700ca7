#!/usr/bin/env bash
# Decode throughput with overlap scheduling on and off, plain and speculative,
# batch 1 and 16, random weights. Usage on a CUDA machine: bash bench/overlap.sh [model preset]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PY:-python3}
MODEL=${1:-smollm2-135m}
SPEC="--speculative-algorithm STANDALONE --speculative-draft-model-path $MODEL --speculative-num-steps 3 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8"
for spec in "" "$SPEC"; do
  for ov in "" "--disable-overlap-schedule"; do
    echo "== ${spec:+spec }${ov:-overlap on}"
    $PY -m specserve.cli bench one-batch --model-path "$MODEL" --load-format dummy \
      --batch-size 1 16 --input-len 128 --output-len 256 $spec $ov 2>&1 | tail -3
  done
done
