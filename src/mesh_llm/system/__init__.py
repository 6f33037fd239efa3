"""What the engines and the model files both stand on, importing nothing else of mesh_llm: the
machine's cores and memory (``machine.py``), the order native libraries must load in
(``native.py``), the BLAS MLX uses on a CPU (``blas.py``), and llama.cpp as a process-wide library
(``llama_lib.py``)."""
