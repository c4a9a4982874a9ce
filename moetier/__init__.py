"""moetier: run Mixture-of-Experts LLMs larger than the GPU at hand."""

__version__ = "0.1.0"
