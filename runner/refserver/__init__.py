"""Reference diffusion server: a small real diffusion transformer behind vLLM-Omni's HTTP API.

Entry point: `runner.refserver.cli:main(argv)`; see docs/refserver.md.
"""
