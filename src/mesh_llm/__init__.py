"""mesh-llm: one OpenAI-compatible API over MLX and llama.cpp engines, on one machine or a mesh."""

from mesh_llm.system import native

native.prepare_llama()  # before any C++ library loads: see system/native.py

__version__ = "0.1.0"
