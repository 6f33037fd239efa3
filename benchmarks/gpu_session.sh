#!/usr/bin/env bash
# The H200 runs, in four device calls made back to back (the machine keeps /tmp while it is held).
# Each call uploads at most 64 MiB, so the wheels and llama.cpp's source travel in separate calls
# (../shared/device/README.md; fill .device/ first with `bash ../shared/device/prepare.sh`).
#
#   1. carry [".device/llama"]  bash benchmarks/gpu_session.sh build   # llama.cpp CUDA, in the background
#   2. carry [".device/a"]      bash benchmarks/gpu_session.sh stage
#   3. carry [".device/b"]      bash benchmarks/gpu_session.sh mlx     # GPU tests, models, MLX runs
#   4. carry [".device/lcp"]    bash benchmarks/gpu_session.sh llama   # llama-server and mesh-llm llama
#
# .device/lcp is llama-cpp-python's Python part (its CPU libraries left out): the mesh-llm llama
# engine loads the CUDA libllama.so through LLAMA_CPP_LIB_PATH.
set -euo pipefail
step=$1
root=$PWD
models=/tmp/models
pair() { echo "$models/$1-mlx,$models/$1.gguf"; }

case $step in
build)
  mkdir -p /tmp/vocab /tmp/dl/.device && cp .device/llama/ggml-vocab-qwen2.gguf /tmp/vocab/
  cp -r .device/llama /tmp/dl/.device/llama
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/llama/gguf-*.whl \
    .device/llama/diskcache-*.whl
  (cd /tmp/dl && setsid nohup bash .device/llama/build-llama.sh > /tmp/llama-build.log 2>&1 &)
  echo "llama.cpp build started"
  ;;
stage)
  bash .device/a/stage.sh
  ;;
mlx)
  source .device/b/install-mlx.sh
  export PYTHONPATH=$root/src:/tmp/site PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/engines/test_mlx.py tests/engines/test_mlx_gpu.py} \
    -s 2>&1 | tee "$OUT/gpu-tests.log" | tail -15 || true
  for shape in qwen2.5-0.5b qwen2.5-7b; do
    [ -f "$models/$shape.gguf" ] || python3 -m mesh_llm.bench.synth "$shape" "$models" \
      --vocab /tmp/vocab/ggml-vocab-qwen2.gguf
  done
  python3 -m mesh_llm bench --model-pair "$(pair qwen2.5-0.5b)" --model-pair "$(pair qwen2.5-7b)" \
    --backends mesh-mlx --runs 3 --out /tmp/bench-mlx 2>&1 | tail -30
  cp /tmp/bench-mlx/results.jsonl "$OUT/mlx-results.jsonl"
  cp /tmp/bench-mlx/summary.json "$OUT/mlx-summary.json"
  if [ -f benchmarks/prompt_cache.py ]; then
    python3 benchmarks/prompt_cache.py --engine mlx --model "$models/qwen2.5-0.5b-mlx" \
      --out "$OUT/prompt-cache-mlx.json" 2>&1 | tail -20
  fi
  ;;
llama)
  for _ in $(seq 1 120); do [ -x /tmp/llama-cuda/bin/llama-server ] && break; sleep 5; done
  tail -3 /tmp/llama-build.log
  export PYTHONPATH=$root/src:/tmp/site:$root/.device/lcp LLAMA_CPP_LIB_PATH=/tmp/llama-cuda/bin \
    PYTHONUNBUFFERED=1
  python3 -m mesh_llm bench --model-pair "$(pair qwen2.5-0.5b)" --model-pair "$(pair qwen2.5-7b)" \
    --backends llama-server,mesh-llama --llama-server /tmp/llama-cuda/bin/llama-server --runs 3 \
    --out /tmp/bench-llama 2>&1 | tail -30
  cp /tmp/bench-llama/results.jsonl "$OUT/llama-results.jsonl"
  cp /tmp/bench-llama/summary.json "$OUT/llama-summary.json"
  tail -c 2000 /tmp/bench-llama/logs/*mesh-llama* 2>/dev/null || true
  ;;
*)
  echo "unknown step $step"; exit 2 ;;
esac
