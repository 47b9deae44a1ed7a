"""Run at image build time: every pin from the build args holds in the finished venv."""

import importlib.metadata as md
import os
import subprocess

env = os.environ
want = {
    "vllm": env["VLLM_VERSION"],
    "torch": f"{env['TORCH_VERSION']}+{env['TORCH_CUDA']}",
    "transformers": env["TRANSFORMERS_VERSION"],
}
for name, version in want.items():
    got = md.version(name)
    assert got == version, f"{name} is {got}, pinned {version}"
for repo, ref in (("/opt/diffusers", env["DIFFUSERS_REF"]), ("/opt/vllm-omni", env["VLLM_OMNI_REF"])):
    head = subprocess.check_output(["git", "-C", repo, "rev-parse", "HEAD"], text=True).strip()
    assert head.startswith(ref), f"{repo} is at {head}, pinned {ref}"
import diffusers  # noqa: E402
import vllm_omni  # noqa: E402

print("pins hold:", want, "diffusers", diffusers.__version__, "vllm_omni", vllm_omni.__file__)
