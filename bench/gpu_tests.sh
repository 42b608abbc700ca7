#!/usr/bin/env bash
# The tests that need CUDA (without it they skip with a reason): the engine on the GPU (CUDA
# graphs equal eager decoding, speculation lossless) and every Triton kernel against its torch
# reference. Quick subset by default; extra arguments go to pytest.
#   bash bench/gpu_tests.sh                  # repo root, CUDA machine
#   bash bench/gpu_tests.sh -m ""            # the slow ones too
#   bash bench/gpu_tests.sh -k lossless
set -uo pipefail
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null
exec $PY -m pytest -q -p no:cacheprovider -m "not slow" tests/test_gpu*.py tests/test_triton_*.py \
  tests/test_step_kernels_engine.py tests/test_prefill_graphs.py tests/test_draft_heads.py \
  tests/test_token_map.py "$@"
