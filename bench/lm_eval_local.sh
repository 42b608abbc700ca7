#!/usr/bin/env bash
# lm-evaluation-harness against `specserve serve`: its `local-completions` model scores each
# choice of a multiple-choice task through /v1/completions (loglikelihood: echo, logprobs=1,
# max_tokens=1; it reads choices[0].logprobs.token_logprobs and top_logprobs), and generates
# short answers to a second task (generate_until: greedy, stop strings), on small local task
# files.
#
# Usage (repo root): bash bench/lm_eval_local.sh
#   MODEL       model for `specserve serve` (default: the packaged smollm2-135m)
#   LM_EVAL     the lm_eval command (default: lm_eval; pip install 'lm-eval[api]' in a venv of
#               its own, it is no dependency of this project)
#   PORT, OUT   server port (default 30123) and work folder (default /tmp/specserve-lm-eval)
#   LIMIT       documents to score (default: all 8)
# lm-eval sends token ids (tokenized_requests), so it needs the model's tokenizer as a folder:
# for a GGUF model it is written from the GGUF here.
set -euo pipefail
MODEL=${MODEL:-smollm2-135m}
LM_EVAL=${LM_EVAL:-lm_eval}
PORT=${PORT:-30123}
OUT=${OUT:-/tmp/specserve-lm-eval}
PY=${PY:-python}
mkdir -p "$OUT/tasks"

# 1. the tokenizer folder, from the GGUF file transformers reads
$PY - "$MODEL" "$OUT/tokenizer" <<'PY'
import os, sys
from transformers import AutoTokenizer
from specserve.model.registry import resolve_packaged
model, out = sys.argv[1], sys.argv[2]
path = resolve_packaged(model) or model
if path.endswith(".gguf"):
    folder, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
else:
    tok = AutoTokenizer.from_pretrained(path)
tok.save_pretrained(out)
print("tokenizer:", out)
PY

# 2. a small local multiple-choice task
cat > "$OUT/tasks/tiny.jsonl" <<'JSONL'
{"question": "The capital of France is", "choices": [" Paris", " Berlin", " Madrid"], "answer": 0}
{"question": "Two plus two equals", "choices": [" four", " seven", " ten"], "answer": 0}
{"question": "The sun rises in the", "choices": [" east", " west", " north"], "answer": 0}
{"question": "Water freezes at zero degrees", "choices": [" Celsius", " Kelvin", " Newton"], "answer": 0}
{"question": "A week has seven", "choices": [" days", " cats", " rivers"], "answer": 0}
{"question": "The opposite of hot is", "choices": [" cold", " loud", " green"], "answer": 0}
{"question": "Cats often chase", "choices": [" mice", " clouds", " trains"], "answer": 0}
{"question": "The color of the sky on a clear day is", "choices": [" blue", " purple", " black"], "answer": 0}
JSONL
cat > "$OUT/tasks/specserve_tiny.yaml" <<YAML
task: specserve_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: $OUT/tasks/tiny.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
YAML
cat > "$OUT/tasks/specserve_tiny_gen.yaml" <<YAML
task: specserve_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: $OUT/tasks/tiny.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Q: Complete the sentence. {{question}}\\nA:"
doc_to_target: "{{choices[answer]}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
YAML

# 3. the server (killed on exit, by its own pid)
$PY -m specserve.cli serve --model-path "$MODEL" --port "$PORT" --served-model-name "$MODEL" \
  > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health"; echo

# 4. lm-eval
$LM_EVAL --model local-completions \
  --model_args "model=$MODEL,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=huggingface,tokenizer=$OUT/tokenizer,num_concurrent=1,max_retries=1" \
  --tasks specserve_tiny,specserve_tiny_gen --include_path "$OUT/tasks" ${LIMIT:+--limit "$LIMIT"} \
  --output_path "$OUT/results" 2>&1 | tee "$OUT/lm_eval.log" | tail -20
