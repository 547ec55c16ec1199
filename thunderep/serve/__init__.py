"""Serving: continuous batching, CUDA-graph decode, the HTTP API, and text generation on N ranks."""
