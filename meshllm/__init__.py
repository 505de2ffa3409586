"""meshllm: serve a Llama-family LLM on a ZeroMQ mesh of edge and fog devices."""

__version__ = "0.1.0"
