#!/usr/bin/env bash
# Static-batch throughput of this engine. Example (GPU, 8B shape, random weights):
#   bench/one_batch.sh --model-path llama3-8b --load-format dummy --batch-size 1 16
exec "$(dirname "$0")/../.venv/bin/specserve" bench one-batch "$@"
