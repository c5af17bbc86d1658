"""ember: an LLM inference server for GPUs at the edge."""

__version__ = "0.1.0"
