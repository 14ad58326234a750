"""Moves multimodal embeddings from encode ranks into prefill ranks' registered buffers."""

__version__ = "0.1.0"
