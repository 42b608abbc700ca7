#!/usr/bin/env bash
# Device profile of batch-1 decode steps on the SmolLM2-135M shape (random weights, a random
# EAGLE head, simulated acceptance so every configuration drafts and verifies its full tree):
# plain, the 5-step chain and two trees. One JSON file per case in $OUT, tables on stdout.
# Usage (repo root, CUDA machine): OUT=/tmp/out [CASES="plain chain5"] bash bench/profile_steps.sh [engine flags]
set -uo pipefail
OUT=${OUT:-/tmp/specserve-profile}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PY:-python3}
MODEL=${MODEL:-smollm2-135m}
LOAD=${LOAD:---load-format dummy}
DRAFT=${DRAFT:-/tmp/eagle-profile}
if [ ! -e "$DRAFT/config.json" ]; then
  $PY - "$DRAFT" "$MODEL" <<'PY'
import sys
from specserve.model.config import PRESETS
from specserve.speculative.eagle_checkpoint import write_random_eagle_checkpoint
write_random_eagle_checkpoint(sys.argv[1], PRESETS[sys.argv[2]], "EAGLE")
PY
fi
CASES=${CASES:-plain chain5 tree8x8x64 tree6x8x32}
prof() {  # name, then engine flags
  local name=$1; shift
  case " $CASES " in *" $name "*) ;; *) return ;; esac
  echo "== $name $(date +%T)"
  timeout ${PROFILE_TIMEOUT:-150} $PY -m specserve.cli bench profile-step --model-path "$MODEL" $LOAD \
    --output-json "$OUT/$name.json" "$@" 2>&1 | grep -v '^USDT\|^\[\|^  \|^\]\|^{\|^}' | head -45
}
SPEC="--speculative-algorithm EAGLE --speculative-draft-model-path $DRAFT --simulate-acc-method match-expected"
prof plain "$@"
prof chain5 $SPEC --speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6 --simulate-acc-len 2 "$@"
prof tree8x8x64 $SPEC --speculative-num-steps 8 --speculative-eagle-topk 8 --speculative-num-draft-tokens 64 --simulate-acc-len 3 "$@"
prof tree8x8x48 $SPEC --speculative-num-steps 8 --speculative-eagle-topk 8 --speculative-num-draft-tokens 48 --simulate-acc-len 3 "$@"
# the same tree with the real (greedy) acceptance path instead of the simulated one: random
# weights accept little, but every step still drafts and verifies the whole tree
prof tree8x8x48greedy --speculative-algorithm EAGLE --speculative-draft-model-path $DRAFT --speculative-num-steps 8 --speculative-eagle-topk 8 --speculative-num-draft-tokens 48 "$@"
prof tree6x8x32 $SPEC --speculative-num-steps 6 --speculative-eagle-topk 8 --speculative-num-draft-tokens 32 --simulate-acc-len 3 "$@"
