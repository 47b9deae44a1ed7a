"""Slurm: the commands (`client`) and what they print (`parse`), used by the slurm backend and preflight."""
