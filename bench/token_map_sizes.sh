#!/usr/bin/env bash
# Which reduced draft vocabulary suits the bundled SmolLM2 draft: token maps of several sizes
# from the target's greedy answers to the training prompts (`specserve token-map`), then the
# held-out accept length (`bench acceptance`) and batch-1 speed (`bench e2e`, engine only) of
# the served tree with each map plus 2,048 growth columns, and with the full vocabulary.
#   OUT=/tmp/maps bash bench/token_map_sizes.sh MODEL.gguf        # CUDA machine
set -uo pipefail
MODEL=${1:?usage: OUT=dir bash bench/token_map_sizes.sh MODEL.gguf}
OUT=${OUT:-/tmp/specserve-token-maps}
SIZES=${SIZES:-4096 8192 16384}
TREE=${TREE:-6,8,64}
GROWTH=${GROWTH:-2048}
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
DRAFT=specserve/data/drafts/smollm2-135m-eagle
mkdir -p "$OUT"
git rev-parse --short HEAD 2>/dev/null

echo "== token maps $(date +%T)"
$PY -m specserve.cli token-map --target "$MODEL" --out "$OUT" --sizes $SIZES --device cuda \
  --generator engine --gen-batch-size 256 --gen-time-budget "${GEN_BUDGET:-60}"

echo "== held-out accept lengths $(date +%T)"
for size in full $SIZES; do
  extra=()
  [ "$size" != full ] && extra=(--engine-arg "speculative_token_map=$OUT/token_map_$size.json"
    --engine-arg "speculative_token_map_growth=$GROWTH")
  $PY -m specserve.cli bench acceptance --target "$MODEL" --draft "$DRAFT" --configs "$TREE" \
    "${extra[@]}" --output "$OUT/acceptance_$size.json" > "$OUT/acceptance_$size.log" 2>&1
  echo "$size: $(tail -n 3 "$OUT/acceptance_$size.log" | tr '\n' ' ')"
done

echo "== bench e2e $(date +%T)"
specs=("$TREE")
for size in $SIZES; do specs+=("$TREE:$OUT/token_map_$size.json+$GROWTH"); done
$PY -m specserve.cli bench e2e --model-path "$MODEL" --draft "$DRAFT" --num-prompts 48 \
  --max-new-tokens 160 --rounds 3 --skip-hf --spec "${specs[@]}" --output-json "$OUT/e2e.json"
