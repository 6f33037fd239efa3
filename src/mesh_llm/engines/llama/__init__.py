"""The llama.cpp engine: GGUF models through llama-cpp-python's low-level API. ``engine.py`` runs the
scheduler's steps on one llama.cpp context; ``batch.py`` fills its batches and samples; ``cache.py``
keeps sequences' cells and the prompt cache's states; ``gguf.py`` reads a file's facts before
loading; ``tokenizer.py`` tokenizes with the model's own vocabulary."""
