#!/usr/bin/env bash
# `specserve bench e2e` (batch-1 chat, plain and a speculative row) for two checkouts of the
# engine on one GPU machine, taken in turn (A, B, A, B, ...) so drift over the run
# falls on both alike; prints each row's median tok/s per checkout and the ratio B / A.
#
#   bench/e2e_two_checkouts.sh DIR_A DIR_B MODEL.gguf DRAFT_DIR [ROUNDS] [OUT_DIR]
#
# Each DIR is a checkout root (the package is imported from there). The speculative row is
# the bundled draft's GPU setting: a 6-step topk-8 tree of 64 tokens over its token map.
set -euo pipefail
a=$(realpath "$1"); b=$(realpath "$2"); model=$(realpath "$3"); draft=$(realpath "$4")
rounds=${5:-3}; out=$(realpath -m "${6:-/tmp/e2e_two_checkouts}")
prompts=${PROMPTS:-48}; tokens=${TOKENS:-160}
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  for side in a b; do
    dir=${!side}
    (cd "$dir" && python3 -m specserve.cli bench e2e --model-path "$model" --draft "$draft" \
      --num-prompts "$prompts" --max-new-tokens "$tokens" --skip-hf --prompt-lookup-tokens 0 \
      --spec "6,8,64:$draft/token_map.json+2048" --output-json "$out/$side-$r.json") \
      > "$out/$side-$r.log" 2>&1 || { tail -20 "$out/$side-$r.log"; exit 1; }
    echo "round $r $side done"
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
rows = {}
for side in "ab":
    for r in range(1, rounds + 1):
        data = json.load(open(f"{out}/{side}-{r}.json"))
        for row in data if isinstance(data, list) else data["rows"]:
            rows.setdefault((row["system"], side), []).append(row)
table = []
for system in dict.fromkeys(s for s, _ in rows):
    med = {side: statistics.median(x["tok_s"] for x in rows[(system, side)]) for side in "ab"}
    acc = rows[(system, "b")][0].get("accept_length")
    table.append({"system": system, "a_tok_s": round(med["a"], 1), "b_tok_s": round(med["b"], 1),
                  "b_over_a": round(med["b"] / med["a"], 4),
                  "a_rounds": [round(x["tok_s"], 1) for x in rows[(system, "a")]],
                  "b_rounds": [round(x["tok_s"], 1) for x in rows[(system, "b")]],
                  "b_accept_length": acc})
print(json.dumps(table))
print("| system | A tok/s (median) | B tok/s (median) | B / A |")
print("|---|---|---|---|")
for t in table:
    print(f"| {t['system']} | {t['a_tok_s']} | {t['b_tok_s']} | {t['b_over_a']} |")
PY
