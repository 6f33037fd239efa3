"""mesh-llm: one OpenAI-compatible API over MLX and llama.cpp engines, on one machine or a mesh."""

__version__ = "0.1.0"
