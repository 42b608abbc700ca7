#!/usr/bin/env bash
# Batch-1 chat speed of the default model, SmolLM2-135M-Instruct: the engine without
# speculation, the engine with its bundled draft as `serving.json` serves it on a GPU (6 steps,
# topk 8, 64 draft tokens, the 16,384-token map + 2,048 growth columns), and HF transformers'
# static cache, all in one process on the same 48 held-out prompts (greedy, 160 new tokens).
# The engine rows run three times in turn; each row reports its median round.
#   bash bench/e2e_batch1.sh MODEL.gguf [more `specserve bench e2e` flags, e.g. --skip-hf]
set -uo pipefail
MODEL=${1:?usage: bash bench/e2e_batch1.sh MODEL.gguf [bench e2e flags]}
shift
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
DRAFT=specserve/data/drafts/smollm2-135m-eagle
git rev-parse --short HEAD 2>/dev/null
# HF's prompt lookup is left out: it is never HF's fastest here and takes minutes at 48 prompts
exec $PY -m specserve.cli bench e2e --model-path "$MODEL" --draft "$DRAFT" \
  --num-prompts 48 --max-new-tokens 160 --rounds 3 --prompt-lookup-tokens 0 \
  --spec "6,8,64:$DRAFT/token_map.json+2048" "$@"
