"""mesh-llm: one OpenAI-compatible API over MLX and llama.cpp engines, on one machine or a mesh."""

from mesh_llm import native

native.prepare_llama()  # before any C++ library loads: see native.py

__version__ = "0.1.0"
