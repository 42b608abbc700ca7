#!/usr/bin/env bash
# Multi-turn chat through the prefix cache, specserve and vLLM (prefix caching on) on one
# machine: 32 conversations x 4 turns sharing a 512-token system prompt (random ids, the same
# for both), SmolLM2-135M shape with random weights, plain and with an EAGLE draft; hit rate,
# TTFT of the first and later turns, output tok/s. JSON per system under OUT_DIR, then a table.
#   bash bench/multiturn_vs_vllm.sh OUT_DIR                 # CUDA machine, vLLM staged
set -uo pipefail
out=${1:?OUT_DIR}
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
DRAFT=specserve/data/drafts/smollm2-135m-eagle
mkdir -p "$out"
echo "== specserve"
$PY -m specserve.cli bench multiturn --model-path smollm2-135m --load-format dummy \
  --speculative-algorithm EAGLE --speculative-draft-model-path "$DRAFT" \
  --speculative-num-steps 6 --speculative-eagle-topk 8 --speculative-num-draft-tokens 64 \
  --variants plain spec --output-json "$out/specserve.json" > "$out/specserve.log" 2>&1 \
  || tail -n 5 "$out/specserve.log"
for variant in plain spec; do
  echo "== vllm $variant"
  extra=()
  [ $variant = spec ] && extra=(--eagle "$DRAFT" --num-speculative-tokens 3)
  $PY bench/vllm_peer.py multiturn --preset smollm2-135m "${extra[@]}" \
    --output-json "$out/vllm-$variant.json" > "$out/vllm-$variant.log" 2>&1 \
    || tail -n 5 "$out/vllm-$variant.log"
done
$PY - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
rows = []
for name in ("specserve.json", "vllm-plain.json", "vllm-spec.json"):
    path = os.path.join(out, name)
    if os.path.exists(path):
        rows += json.load(open(path))
keys = ["system", "hit_rate", "ttft_first_turn_ms", "ttft_later_turns_ms", "output_tok_s",
        "accept_length"]
print(" | ".join(keys)); print(" | ".join("---" for _ in keys))
for r in rows:
    print(" | ".join(f"{r.get(k):.3g}" if isinstance(r.get(k), float) else str(r.get(k))
                     for k in keys))
PY
