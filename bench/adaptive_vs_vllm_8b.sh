#!/usr/bin/env bash
# Load-adaptive speculation at the Llama-3-8B shape against vLLM, for ratios measured on one
# machine (random weights; a random EAGLE3 head with a 32k draft vocabulary; acceptance forced
# to 1..4; 512-token prompts, 256 new tokens, greedy, bf16). A vLLM engine takes 75-170 s to
# start, so the work is split in parts, each small enough for one device call; every part
# writes JSON under OUT_DIR and `table` joins them (ratios against vLLM's best, a plot).
#   bash bench/adaptive_vs_vllm_8b.sh OUT_DIR PART [BATCH_SIZES]      # CUDA machine
# PART: specserve (plain, fixed chain 3, fixed tree, adaptive at each accept length),
#       vllm-plain, vllm-accept1 .. vllm-accept4 (its chain of 3, synthetic acceptance),
#       vllm-chainK-acceptL (a chain of K, 1..5, at accept length L), table.
# vLLM must be importable (the peers' README says how to stage it on the GPU machine).
set -uo pipefail
out=${1:?OUT_DIR}; part=${2:?PART}; sizes=${3:-"1 16 64 128 256"}
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
DRAFT=${DRAFT:-/tmp/eagle3-8b-random}  # the random head both engines draft with
mkdir -p "$out"
write_draft() {  # (the specserve part writes it too, on a machine that may be a new one)
  [ -e "$DRAFT/config.json" ] || $PY -c "import sys; from specserve.model.config import PRESETS; \
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint as w; \
w(sys.argv[1], PRESETS['llama3-8b'], 'EAGLE3', draft_vocab_size=32000)" "$DRAFT"
}
theirs() {  # name, flags...
  local name=$1; shift
  echo "== vllm $name"
  $PY bench/vllm_peer.py one-batch --preset llama3-8b --batch-size $sizes --input-len 512 \
    --output-len 256 "$@" --output-json "$out/vllm-$name.json" > "$out/vllm-$name.log" 2>&1 \
    || tail -n 5 "$out/vllm-$name.log"
}
case $part in
  specserve) DRAFT=$DRAFT bash bench/adaptive_speculation_8b.sh "$out" "1 2 3 4" "$sizes" \
    "adaptive chain3 tree" ;;
  vllm-plain) theirs plain ;;
  vllm-accept[1-4]|vllm-chain[1-5]-accept[1-4])
    acc=${part##*-accept}; chain=3
    [[ $part == vllm-chain* ]] && { chain=${part#vllm-chain}; chain=${chain%%-*}; }
    write_draft
    theirs "chain$chain-accept$acc" --eagle3 "$DRAFT" --num-speculative-tokens "$chain" \
      --synthetic-acceptance "$acc" ;;
  table) $PY bench/plot_throughput.py "$out" --title "Llama-3-8B shape, EAGLE3, forced acceptance" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
