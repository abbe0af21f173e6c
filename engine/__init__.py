"""memra: an LLM inference engine driving NVIDIA GPUs through cuda-python, with a numpy reference backend."""

__version__ = "0.1.0"
