"""The MLX engine: Hugging Face safetensors models (and GGUF, converted on load) on Metal, CUDA or
the CPU. ``engine.py`` runs the scheduler's steps; ``load.py`` builds the model; ``batch.py`` and
``cache.py`` hold the batch's rows and KV memory; ``sampling.py`` samples; ``projections.py`` fuses
weights; ``kernels/`` holds the CUDA kernels MLX lacks."""
