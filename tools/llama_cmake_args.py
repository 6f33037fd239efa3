"""CMAKE_ARGS for building llama-cpp-python on this machine: the CPU's own vector extensions, but never
AMX. ggml's AMX kernels crash in ggml_backend_amx_mul_mat on the Xeon (Sapphire Rapids) machines we
run on (seen 2026-12-02: any prompt of more than one token), and -march=native turns them on."""

import platform
from pathlib import Path

FLAGS = {  # ggml CMake option -> /proc/cpuinfo flags it needs
    "GGML_AVX": ["avx"], "GGML_AVX2": ["avx2"], "GGML_FMA": ["fma"], "GGML_F16C": ["f16c"],
    "GGML_BMI2": ["bmi2"], "GGML_AVX_VNNI": ["avx_vnni"],
    "GGML_AVX512": ["avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"],
    "GGML_AVX512_VBMI": ["avx512vbmi"], "GGML_AVX512_VNNI": ["avx512_vnni"],
    "GGML_AVX512_BF16": ["avx512_bf16"],
}


def main() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.exists():
        return  # other machines: llama.cpp's own defaults
    have = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            break
    on = [opt for opt, need in FLAGS.items() if all(f in have for f in need)]
    print(" ".join(["-DGGML_NATIVE=OFF", *(f"-D{o}=ON" for o in on),
                    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]))


if __name__ == "__main__":
    main()
