#!/usr/bin/env bash
# Decode throughput of the Llama-3-8B shape (random weights, no download) at tensor-parallel
# sizes 1 and 2, batch 1 / 16 / 64, greedy, bf16, in one call: each size's
# `specserve bench one-batch` JSON, then one JSON list and a table of tok/s per batch with the
# tp 2 / tp 1 ratio. Needs 2 GPUs (tp 2 runs on cuda:0 and cuda:1).
#   bash bench/tensor_parallel_8b.sh [more `specserve bench one-batch` flags]
set -euo pipefail
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=$(mktemp -d)
git rev-parse --short HEAD 2>/dev/null || true
BASE=(--model-path llama3-8b --load-format dummy --batch-size 1 16 64 --input-len 512 --output-len 256)
for TP in 1 2; do
  echo "== tp_size $TP"
  $PY -m specserve.cli bench one-batch "${BASE[@]}" --tp-size "$TP" "$@" | tee "$OUT/tp$TP.txt"
done
$PY - "$OUT" <<'PY'
import json, sys

def rows(path):  # one-batch prints its JSON list first, then a table
    text = open(path).read()
    return json.JSONDecoder().raw_decode(text[text.index("[\n"):])[0]

tp1, tp2 = (rows(f"{sys.argv[1]}/tp{n}.txt") for n in (1, 2))
table = []
for a, b in zip(tp1, tp2):
    one, two = a["decode_throughput_tok_s"], b["decode_throughput_tok_s"]
    table.append({"batch_size": a["batch_size"], "tp1_tok_s": one, "tp2_tok_s": two, "tp2_over_tp1": two / one})
print(json.dumps(table, indent=2))
print("batch | tp 1 tok/s | tp 2 tok/s | tp 2 / tp 1")
print("--- | --- | --- | ---")
for r in table:
    print(f"{r['batch_size']} | {r['tp1_tok_s']:.1f} | {r['tp2_tok_s']:.1f} | {r['tp2_over_tp1']:.2f}x")
PY
