"""The reference server's Qwen-Image denoiser: diffusers' `QwenImageTransformer2DModel` with random weights,
its memory counted from the tensors themselves on the CPU (ledger.py), the conditioning prefix cached through an
attention processor on the real blocks (prefix.py)."""

# Whenever scipy is installed (scoring's scikit-image brings it), diffusers imports scipy.stats for schedulers this
# server never uses: ~1 CPU-s, a third of a Qwen-Image start (benchmarks/server_start.py). Told that scipy is
# absent, it skips them; nothing this server runs asks for scipy.
from diffusers.utils import import_utils as _diffusers_imports

_diffusers_imports._scipy_available = False
