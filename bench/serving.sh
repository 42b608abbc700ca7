#!/usr/bin/env bash
# Load-test a running `specserve serve` (Poisson arrivals or fixed concurrency). Examples:
#   .venv/bin/specserve serve --port 30000 &                       # real model, chat template
#   bench/serving.sh --num-prompts 50 --request-rate 2 --output-len 64 --plot serving.png
#   bench/serving.sh --dataset random --endpoint completions --input-len 256 --max-concurrency 8
exec "$(dirname "$0")/../.venv/bin/specserve" bench serving "$@"
