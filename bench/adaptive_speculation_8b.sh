#!/usr/bin/env bash
# Load-adaptive speculation at the Llama-3-8B shape (random weights, a random EAGLE3 head with
# a 32k draft vocabulary), acceptance forced to each of ACCEPT_LENGTHS: plain decoding,
# adaptive over a 5-step topk-4 tree of 16 tokens (tiers: plain, a chain of 3, the tree), the
# fixed 3-step chain and the fixed tree, `specserve bench one-batch` at several batch sizes
# (512-token prompts, 256 new tokens, greedy, bf16). A log and a JSON (specserve-NAME.json)
# per configuration under OUT_DIR.
#   bash bench/adaptive_speculation_8b.sh OUT_DIR [ACCEPT_LENGTHS] [BATCH_SIZES] [CONFIGS]
# CONFIGS: any of "adaptive chain3 tree" (default "adaptive chain3"); plain always runs.
set -uo pipefail
out=${1:-/tmp/adaptive_8b}; accepts=${2:-"1 3"}; sizes=${3:-"1 16 64 256"}
configs=" ${4:-adaptive chain3} "
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
DRAFT=${DRAFT:-/tmp/eagle3-8b-random}
mkdir -p "$out"
if [ ! -e "$DRAFT/config.json" ]; then
  $PY - "$DRAFT" <<'PY'
import sys
from specserve.model.config import PRESETS
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
write_random_eagle_checkpoint(sys.argv[1], PRESETS["llama3-8b"], "EAGLE3", draft_vocab_size=32000)
PY
fi
BASE=(--model-path llama3-8b --load-format dummy --input-len 512 --output-len 256 --batch-size $sizes)
EAGLE3=(--speculative-algorithm EAGLE3 --speculative-draft-model-path "$DRAFT")
run() {  # name, flags...
  local name=$1; shift
  echo "== $name"
  $PY -m specserve.cli bench one-batch "${BASE[@]}" "$@" --output-json "$out/specserve-$name.json" \
    > "$out/$name.log" 2>&1
  tail -n $(( $(echo $sizes | wc -w) + 2 )) "$out/$name.log"
}
[ -e "$out/plain.log" ] || run plain
for acc in $accepts; do
  forced=(--simulate-acc-len "$acc" --simulate-acc-method match-expected)
  [[ $configs == *" adaptive "* ]] && run "adaptive-accept$acc" "${EAGLE3[@]}" \
    --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16 \
    --speculative-adaptive "${forced[@]}"
  [[ $configs == *" chain3 "* ]] && run "chain3-accept$acc" "${EAGLE3[@]}" \
    --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 "${forced[@]}"
  [[ $configs == *" tree "* ]] && run "tree-accept$acc" "${EAGLE3[@]}" \
    --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16 "${forced[@]}"
done
