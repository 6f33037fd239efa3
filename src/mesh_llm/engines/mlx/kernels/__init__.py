"""CUDA kernels for MLX on NVIDIA GPUs, compiled at run time with NVRTC (``nvrtc.py``): paged
attention over a batch's rows (``attention.py``) and quantized matrix-vector products for decode
(``quantized.py``). Each falls back to MLX's own operations where they cannot run."""
