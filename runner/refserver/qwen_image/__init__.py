"""The reference server's Qwen-Image denoiser: diffusers' `QwenImageTransformer2DModel` with random weights,
its memory counted from the tensors themselves on the CPU (ledger.py), the conditioning prefix cached through an
attention processor on the real blocks (prefix.py)."""
