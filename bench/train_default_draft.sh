#!/usr/bin/env bash
# Train the bundled EAGLE draft of the default model (SmolLM2-135M-Instruct) on one GPU (under ten
# minutes on an H200 with the defaults below), then measure it on the held-out prompts.
#
#   OUT=/tmp/out bash bench/train_default_draft.sh smollm2.gguf
#
# Stages (each prints timestamped progress to $OUT/run.log and $OUT/train.log, so a timeout
# still leaves evidence):
#   1. generate  self-distillation answers for the bundled train prompts: one greedy pass, then
#                sampled passes, until GEN_BUDGET; engine workers (specserve.Engine, the
#                serving path) and a dense worker share the GPU and the job queue
#   2. features  one forward of the target per answer: its final hidden states and top-4 tokens
#                (with HEAD=eagle3 also the three layers' residual streams an EAGLE3 head reads)
#   3. train     the EAGLE-1 head (HEAD=eagle3: an EAGLE3 head) on the GPU (bf16, BATCH_TOKENS tokens per step, training-time
#                test over TTT_STEPS unrolled steps) for TRAIN_BUDGET seconds, with a learning-rate
#                schedule that runs on the clock; the draft in $OUT/draft is rewritten at every
#                checkpoint (CKPT_SECONDS) and $OUT/train_curve.json with it
#   4. measure   `specserve bench acceptance` on the held-out prompts, every configuration in its
#                own process at once (chains 3/5/7, trees topk 4 and 8 with 16..64 tokens), plus
#                chain-5 on training prompts (the generalisation gap); ACC_TIMEOUT each
#   5. a table   accept lengths, data and training figures; everything also in summary.json
#   6. optional  (E2E_TIMEOUT > 0) `bench e2e`, batch-1 tok/s of the engine with and without it
#                (E2E_HF=1: and of HF transformers, in the same run)
# Budgets and knobs are environment variables (defaults below). Work files (answers, feature
# shards, checkpoint.pt: several GB) go to $WORK, outside $OUT.
set -uo pipefail

MODEL=${1:?usage: OUT=dir bash bench/train_default_draft.sh MODEL (e.g. smollm2.gguf)}
OUT=${OUT:-/tmp/train_default_draft}
WORK=${WORK:-/tmp/specserve_train_work}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
GEN_BUDGET=${GEN_BUDGET:-120}
TRAIN_BUDGET=${TRAIN_BUDGET:-220}
ACC_TIMEOUT=${ACC_TIMEOUT:-75}
CKPT_SECONDS=${CKPT_SECONDS:-45}
GENERATOR=${GENERATOR:-engine:4,dense:1}
GEN_BATCH=${GEN_BATCH:-256}
NUM_PROMPTS=${NUM_PROMPTS:-12000}
MAX_NEW=${MAX_NEW:-192}
SAMPLED_PASSES=${SAMPLED_PASSES:-30}
TEMPS=${TEMPS:-0.8 0.6 1.0}
ENGINE_ARGS=${ENGINE_ARGS:-cuda_graph_max_bs=256}
BATCH_TOKENS=${BATCH_TOKENS:-32768}
LR=${LR:-2e-3}
WARMUP=${WARMUP:-0.05}
HEAD=${HEAD:-eagle}                   # eagle (EAGLE-1, the committed draft) or eagle3
DRAFT_LAYERS=${DRAFT_LAYERS:-1}       # eagle: decoder layers in the head (the committed: 1)
DRAFT_VOCAB=${DRAFT_VOCAB:-16384}
TTT_STEPS=${TTT_STEPS:-6}
TTT_DECAY=${TTT_DECAY:-0.8}
FEATURE_WEIGHT=${FEATURE_WEIGHT:-1.0}
TOKEN_WEIGHT=${TOKEN_WEIGHT:-1.0}
EXTRA_TRAIN_ARGS=${EXTRA_TRAIN_ARGS:-}
ACC_PROMPTS=${ACC_PROMPTS:-50}
ACC_MAX_NEW=${ACC_MAX_NEW:-128}
ACC_CONFIGS=${ACC_CONFIGS:-3,1,4 5,1,6 7,1,8 5,4,16 8,4,32 6,8,32 8,8,64 5,8,64}
ACC_KV=${ACC_KV:-65536}
E2E_TIMEOUT=${E2E_TIMEOUT:-0}         # > 0: stage 6, `bench e2e` with the draft (engine only)
E2E_SPECS=${E2E_SPECS:-5,1,6 8,8,64 5,8,64}
E2E_HF=${E2E_HF:-0}                   # 1: stage 6 also times HF transformers (static cache, prompt lookup)
# RESUME=1 trains the draft in $WORK/checkpoint.pt on (its data is reused) for another
# TRAIN_BUDGET seconds; the schedule then spans the seconds trained before plus this budget
RESUME=${RESUME:-0}

START=$(date +%s)
mkdir -p "$OUT" "$WORK"
DRAFT="$OUT/draft"
log() { echo "[$(date +%H:%M:%S) +$(($(date +%s) - START))s] $*" | tee -a "$OUT/run.log"; }

# ---- 0. setup ------------------------------------------------------------------------------------
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
log "model $MODEL ($(sha256sum "$MODEL" 2>/dev/null | cut -c1-16)...), out $OUT, work $WORK"
log "budgets: generate $GEN_BUDGET s, train $TRAIN_BUDGET s, measure $ACC_TIMEOUT s per process"
$PY -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '', 'python', sys.version.split()[0])" 2>&1 | tee -a "$OUT/run.log"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee -a "$OUT/run.log"

# an exclusive-process GPU takes one process at a time: one in-process generator, and the
# measurements in one process, configuration after configuration
PARALLEL=1
MODE=$(nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -n 1)
case "$MODE" in
  Exclusive*) PARALLEL=0; GENERATOR=dense; log "GPU compute mode $MODE: one process at a time" ;;
esac

ENGINE_FLAGS=()
for a in $ENGINE_ARGS; do ENGINE_FLAGS+=(--engine-arg "$a"); done
RESUME_FLAG=()
[ "$RESUME" = 1 ] && RESUME_FLAG=(--resume)

# ---- 1-3. generate, features, train (one process; its own timestamped lines) ---------------------
log "stage 1-3: train-eagle (generation budget $GEN_BUDGET s, training budget $TRAIN_BUDGET s)"
# shellcheck disable=SC2086
$PY -m specserve.cli train-eagle --target "$MODEL" --out "$DRAFT" --work-dir "$WORK" \
  --device "$DEVICE" --seed 0 --head "$HEAD" --draft-layers "$DRAFT_LAYERS" --draft-vocab "$DRAFT_VOCAB" \
  --num-prompts "$NUM_PROMPTS" --max-new-tokens "$MAX_NEW" --generator "$GENERATOR" \
  --gen-batch-size "$GEN_BATCH" --sampled-passes "$SAMPLED_PASSES" --temperature $TEMPS \
  --gen-time-budget "$GEN_BUDGET" "${ENGINE_FLAGS[@]}" \
  --epochs 0 --time-budget "$TRAIN_BUDGET" "${RESUME_FLAG[@]}" \
  --batch-tokens "$BATCH_TOKENS" --lr "$LR" --warmup "$WARMUP" \
  --ttt-steps "$TTT_STEPS" --ttt-decay "$TTT_DECAY" \
  --feature-weight "$FEATURE_WEIGHT" --token-weight "$TOKEN_WEIGHT" \
  --save-every 0 --save-every-seconds "$CKPT_SECONDS" --log-every 25 \
  --curve-file "$OUT/train_curve.json" $EXTRA_TRAIN_ARGS \
  > "$OUT/train.log" 2>&1 &
TRAIN_PID=$!
# mirror the timestamped lines (not the progress bars) into run.log while it runs
tail -n +1 -f "$OUT/train.log" --pid=$TRAIN_PID 2>/dev/null | grep --line-buffered -E '^\[|Error|error|Traceback' | tee -a "$OUT/run.log" &
wait $TRAIN_PID
TRAIN_RC=$?
sleep 1
log "train-eagle exited with $TRAIN_RC"
cp "$WORK/data/manifest.json" "$OUT/data_manifest.json" 2>/dev/null
if [ ! -f "$DRAFT/model.safetensors" ]; then
  log "no draft was written; last lines of train.log:"
  tail -n 40 "$OUT/train.log" | tee -a "$OUT/run.log"
  exit 1
fi

# ---- 4. measure: every configuration in its own process, at once --------------------------------
log "stage 4: bench acceptance (${ACC_PROMPTS} held-out prompts, ${ACC_MAX_NEW} new tokens, greedy)"
run_acc() {  # name prompts "configs"
  # shellcheck disable=SC2086
  timeout -k 5 "$ACC_TIMEOUT" $PY -m specserve.cli bench acceptance --target "$MODEL" \
    --draft "$DRAFT" --prompts "$2" --configs $3 --num-prompts "$ACC_PROMPTS" \
    --max-new-tokens "$ACC_MAX_NEW" --output "$OUT/acceptance_$1.json" \
    "${ENGINE_FLAGS[@]}" --engine-arg "max_total_tokens=$ACC_KV" \
    > "$OUT/acceptance_$1.log" 2>&1
  local rc=$?
  echo "[$(date +%H:%M:%S) +$(($(date +%s) - START))s] acceptance $1 ($3 on $2) exited with $rc" | tee -a "$OUT/run.log"
}
if [ "$PARALLEL" = 1 ]; then
  for c in $ACC_CONFIGS; do
    run_acc "heldout_${c//,/_}" heldout "$c" &
  done
  run_acc "train_5_1_6" train "5,1,6" &
  wait
else  # one process: its JSON is rewritten after every configuration
  # shellcheck disable=SC2086
  run_acc heldout_all heldout "$(echo $ACC_CONFIGS)"
fi

# ---- 5. the table --------------------------------------------------------------------------------
log "stage 5: summary"
$PY - "$OUT" <<'EOF' 2>&1 | tee -a "$OUT/run.log"
import glob, json, os, sys
out = sys.argv[1]
rows = []
for path in sorted(glob.glob(os.path.join(out, "acceptance_*.json"))):
    name = os.path.basename(path)[len("acceptance_"):-len(".json")]
    for r in json.load(open(path))["rows"]:
        rows.append({"prompts": name.split("_")[0], **r})
summary = {"acceptance": rows}
try:
    ta = json.load(open(os.path.join(out, "draft", "training_args.json")))
    d, t = ta["data"], ta["train"]
    summary["data"] = {k: d.get(k) for k in ("num_sequences", "num_tokens", "num_answer_tokens", "num_ended", "generate_seconds", "feature_seconds")}
    summary["train"] = {k: t.get(k) for k in ("steps", "epochs", "train_seconds", "num_loss_positions", "final")}
except (OSError, KeyError, ValueError) as e:
    summary["train_error"] = repr(e)
    try:
        curve = json.load(open(os.path.join(out, "train_curve.json")))
        summary["train"] = {"last_eval": curve["evals"][-1] if curve["evals"] else None}
    except (OSError, KeyError, ValueError):
        pass
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
print(json.dumps({k: v for k, v in summary.items() if k != "acceptance"}, indent=1))
print()
print("| prompts | config | steps | topk | draft tokens | accept length | per request | histogram (1..) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
order = {"heldout": 0, "train": 1}
for r in sorted(rows, key=lambda r: (order.get(r["prompts"], 2), r["topk"], r["num_draft_tokens"])):
    print(f"| {r['prompts']} | {r['config']} | {r['num_steps']} | {r['topk']} | {r['num_draft_tokens']} | "
          f"{r['accept_length']:.3f} | {r['accept_length_per_request']:.3f} | {' '.join(map(str, r['histogram']))} |")
held = [r for r in rows if r["prompts"] == "heldout"]
chain5 = [r["accept_length"] for r in held if r["topk"] == 1 and r["num_steps"] == 5]
trees = [r["accept_length"] for r in held if r["topk"] > 1]
print()
print(f"held-out accept length: chain-5 {chain5[0] if chain5 else 'n/a'}, best tree {max(trees) if trees else 'n/a'}")
EOF

# ---- 6. optional: batch-1 speed of the engine with this draft -------------------------------------
if [ "$E2E_TIMEOUT" -gt 0 ]; then
  HF_FLAG=(--skip-hf); [ "$E2E_HF" = 1 ] && HF_FLAG=()
  log "stage 6: bench e2e (specs $E2E_SPECS; HF transformers too: $E2E_HF)"
  # shellcheck disable=SC2086
  timeout -k 5 "$E2E_TIMEOUT" $PY -m specserve.cli bench e2e --model-path "$MODEL" --draft "$DRAFT" \
    --num-prompts 6 --max-new-tokens 160 --spec $E2E_SPECS "${HF_FLAG[@]}" \
    --output-json "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
  log "bench e2e exited with $?"
  tail -n 12 "$OUT/e2e.log" | tee -a "$OUT/run.log"
fi
log "done; total $(($(date +%s) - START)) s"
