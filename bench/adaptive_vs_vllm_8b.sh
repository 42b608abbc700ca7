#!/usr/bin/env bash
# Load-adaptive speculation at the Llama-3-8B shape against vLLM, for ratios measured on one
# machine (random weights; a random EAGLE3 head with a 32k draft vocabulary; acceptance forced
# to 1..4; 512-token prompts, 256 new tokens, greedy, bf16). A vLLM engine takes 75-170 s to
# start, so the work is split in parts, each small enough for one device call; every part
# writes JSON under OUT_DIR and `table` joins them (ratios against vLLM's best, a plot).
#   bash bench/adaptive_vs_vllm_8b.sh OUT_DIR PART [BATCH_SIZES]      # CUDA machine
# PART: specserve (plain, fixed chain 3, fixed tree, adaptive at each accept length),
#       vllm-plain, vllm-accept1 .. vllm-accept4 (its chain of 3, synthetic acceptance), table.
# vLLM must be importable (the peers' README says how to stage it on the GPU machine).
set -uo pipefail
out=${1:?OUT_DIR}; part=${2:?PART}; sizes=${3:-"1 16 64 128 256"}
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
TREE=(--speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16)
CHAIN=(--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4)
ours() {  # name, flags...
  local name=$1; shift
  echo "== specserve $name"
  $PY -m specserve.cli bench one-batch "${BASE[@]}" "$@" --output-json "$out/specserve-$name.json" \
    > "$out/specserve-$name.log" 2>&1 || tail -n 5 "$out/specserve-$name.log"
}
theirs() {  # name, flags...
  local name=$1; shift
  echo "== vllm $name"
  $PY bench/vllm_peer.py one-batch --preset llama3-8b --batch-size $sizes --input-len 512 \
    --output-len 256 "$@" --output-json "$out/vllm-$name.json" > "$out/vllm-$name.log" 2>&1 \
    || tail -n 5 "$out/vllm-$name.log"
}
case $part in
  specserve)
    ours plain
    for acc in 1 2 3 4; do
      forced=(--simulate-acc-len "$acc" --simulate-acc-method match-expected)
      ours "chain3-accept$acc" "${EAGLE3[@]}" "${CHAIN[@]}" "${forced[@]}"
      ours "tree-accept$acc" "${EAGLE3[@]}" "${TREE[@]}" "${forced[@]}"
      ours "adaptive-accept$acc" "${EAGLE3[@]}" "${TREE[@]}" --speculative-adaptive "${forced[@]}"
    done ;;
  vllm-plain) theirs plain ;;
  vllm-accept[1-4])
    acc=${part#vllm-accept}
    theirs "chain3-accept$acc" --eagle3 "$DRAFT" --num-speculative-tokens 3 \
      --synthetic-acceptance "$acc" ;;
  table) $PY bench/plot_throughput.py "$out" --title "Llama-3-8B shape, EAGLE3, forced acceptance" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
