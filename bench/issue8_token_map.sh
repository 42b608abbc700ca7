#!/usr/bin/env bash
# Reduced draft vocabularies for the bundled SmolLM2 draft, in two device calls (issue 8):
#   PART=maps: token maps of several sizes from the target's greedy answers to the bundled
#              training prompts, the top-k kernel tests, device profiles of the k8 n48 step
#              with and without a map (and with the skinny GEMM at verify sizes), and held-out
#              accept lengths with each map (50 prompts, 128 tokens);
#   PART=e2e:  `bench e2e` (16 held-out prompts, HF in the same run) with each map.
# Usage (repo root, CUDA machine): OUT=/tmp/out PART=maps|e2e bash bench/issue8_token_map.sh MODEL.gguf
# The maps land in $MAPS (default /root/maps; kept between calls on a warm machine) and $OUT/maps.
set -uo pipefail
MODEL=${1:?usage: OUT=dir PART=maps|e2e bash bench/issue8_token_map.sh MODEL.gguf}
OUT=${OUT:-/tmp/specserve-token-map}
MAPS=${MAPS:-/root/maps}
SIZES=${SIZES:-2048 4096 8192 16384}
DRAFT=specserve/data/drafts/smollm2-135m-eagle
mkdir -p "$OUT" "$MAPS" /tmp/tm  # $OUT: at most 8 files come back
PY=${PY:-python3}
if [ -d .whl ] && ! $PY -c "import gguf" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
git rev-parse HEAD 2>/dev/null

if [ "${PART:-maps}" = maps ]; then
  echo "== token maps $(date +%T)"
  timeout ${MAP_TIMEOUT:-150} $PY -m specserve.cli token-map --target "$MODEL" --out "$MAPS" \
    --sizes $SIZES --num-prompts ${NUM_PROMPTS:-12000} --device cuda --generator engine \
    --gen-batch-size 256 --gen-time-budget ${GEN_BUDGET:-60} 2>&1 | grep -v "^\[.*generated\|it/s" | tail -8
  mkdir -p "$OUT/maps" && cp "$MAPS"/token_map_*.json "$OUT/maps/"

  echo "== tests $(date +%T)"
  timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_triton_topk.py tests/test_token_map.py \
    2>&1 | tail -2

  echo "== profiles $(date +%T)"
  MAP8K=$MAPS/token_map_8192.json
  OUT=/tmp/tm/profile CASES=tree8x8x48greedy bash bench/profile_steps.sh 2>&1 | grep "^decode steps"
  OUT=$OUT/profile_map CASES=tree8x8x48greedy bash bench/profile_steps.sh \
    --speculative-token-map "$MAP8K" 2>&1 | grep "^decode steps"
  SPECSERVE_SKINNY_MAX_TOKENS=64 OUT=/tmp/tm/profile_map_skinny CASES=tree8x8x48greedy \
    bash bench/profile_steps.sh --speculative-token-map "$MAP8K" 2>&1 | grep "^decode steps"
  SPECSERVE_SKINNY_MAX_TOKENS=64 OUT=/tmp/tm/profile_skinny CASES=plain \
    bash bench/profile_steps.sh 2>&1 | grep "^decode steps"

  echo "== acceptance $(date +%T)"
  for size in none $SIZES; do
    extra=""
    [ "$size" != none ] && extra="--engine-arg speculative_token_map=$MAPS/token_map_$size.json"
    timeout ${ACC_TIMEOUT:-120} $PY -m specserve.cli bench acceptance --target "$MODEL" --draft $DRAFT \
      --configs 5,1,6 8,8,48 $extra --output "/tmp/tm/acceptance_$size.json" > "/tmp/tm/acceptance_$size.log" 2>&1 &
  done
  wait
  for size in none $SIZES; do
    $PY - "/tmp/tm/acceptance_$size.json" "$size" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except (OSError, ValueError) as e:
    rows = []
    print(sys.argv[2], "no result", e)
print(sys.argv[2], " ".join(f"{r['config']} {r['accept_length']:.3f}" for r in rows))
PY
  done
else
  echo "== e2e $(date +%T)"
  specs="8,8,48"
  for size in ${E2E_SIZES:-4096 8192 16384}; do specs="$specs 8,8,48:$MAPS/token_map_$size.json"; done
  timeout ${E2E_TIMEOUT:-420} $PY -m specserve.cli bench e2e --model-path "$MODEL" --draft $DRAFT \
    --num-prompts ${NUM_PROMPTS:-16} --max-new-tokens 160 --spec $specs ${E2E_EXTRA:-} \
    --output-json "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
  echo "e2e rc $?"
  grep "^system\|^---\|^specserve\|^hf-" "$OUT/e2e.log"
fi
