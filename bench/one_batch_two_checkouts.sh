#!/usr/bin/env bash
# `specserve bench one-batch` for two checkouts of the engine on one GPU machine, taken in turn
# (A, B, A, B, ...) so that drift over the call falls on both alike; prints each batch size's
# decode tok/s per round, the medians and the ratio B / A.
#
#   bench/one_batch_two_checkouts.sh DIR_A DIR_B OUT_DIR [ROUNDS] -- [one-batch flags...]
#   e.g. ... /tmp/old . /tmp/ab 3 -- --model-path llama3-8b --load-format dummy \
#            --batch-size 1 16 --input-len 512 --output-len 256
#
# Each DIR is a checkout root (the package is imported from there; `git archive REV specserve
# | tar -x -C DIR` makes one). STOP_AFTER (seconds, default none): start no round after it.
set -uo pipefail
a=$(realpath "$1"); b=$(realpath "$2"); out=$(realpath -m "$3"); shift 3
rounds=3
if [ $# -gt 0 ] && [ "$1" != "--" ]; then rounds=$1; shift; fi
[ "${1:-}" = "--" ] && shift
mkdir -p "$out"
done_rounds=0
for r in $(seq 1 "$rounds"); do
  if [ -n "${STOP_AFTER:-}" ] && [ "$SECONDS" -gt "$STOP_AFTER" ]; then
    echo "no time for round $r"; break
  fi
  for side in a b; do
    dir=${!side}
    (cd "$dir" && PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} python3 -m specserve.cli bench one-batch \
      "$@" --output-json "$out/$side-$r.json") > "$out/$side-$r.log" 2>&1 \
      || { tail -5 "$out/$side-$r.log"; exit 1; }
    echo "round $r $side done"
  done
  done_rounds=$r
done
[ "$done_rounds" -gt 0 ] || { echo "no round ran" >&2; exit 1; }
python3 - "$out" "$done_rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
runs = {}
for side in "ab":
    for r in range(1, rounds + 1):
        for row in json.load(open(f"{out}/{side}-{r}.json")):
            runs.setdefault((side, row["batch_size"]), []).append(row["decode_throughput_tok_s"])
table = []
for bs in sorted({bs for _, bs in runs}):
    a, b = statistics.median(runs[("a", bs)]), statistics.median(runs[("b", bs)])
    table.append({"batch_size": bs, "a_tok_s": round(a, 1), "b_tok_s": round(b, 1),
                  "b_over_a": round(b / a, 4), "a_rounds": [round(x, 1) for x in runs[("a", bs)]],
                  "b_rounds": [round(x, 1) for x in runs[("b", bs)]]})
print(json.dumps(table))
print("| batch | A tok/s (median) | B tok/s (median) | B / A |")
print("|---|---|---|---|")
for t in table:
    print(f"| {t['batch_size']} | {t['a_tok_s']} | {t['b_tok_s']} | {t['b_over_a']} |")
PY
