"""runner: a benchmark matrix runner for GPU diffusion serving."""

__version__ = "0.1.0"
