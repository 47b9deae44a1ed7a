#!/usr/bin/env bash
# Build the pinned vLLM-Omni image on a machine with registry, PyPI and GitHub access (and enough disk:
# the result is ~20 GB). The pins are build args; override one with its env var, e.g. VLLM_OMNI_REF=abc123.
#   docker/vllm-omni/build.sh                    # tag runner-vllm-omni:8484d85d1
#   DOCKER_HOST=ssh://anodyine@host docker/vllm-omni/build.sh   # build on the GPU host itself
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

CUDA_IMAGE="${CUDA_IMAGE:-nvidia/cuda:13.0.0-devel-ubuntu24.04}"
PYTHON_VERSION="${PYTHON_VERSION:-3.13}"
VLLM_VERSION="${VLLM_VERSION:-0.31.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_CUDA="${TORCH_CUDA:-cu130}"
TRANSFORMERS_VERSION="${TRANSFORMERS_VERSION:-5.14.1}"
DIFFUSERS_REPO="${DIFFUSERS_REPO:-https://github.com/huggingface/diffusers.git}"
DIFFUSERS_REF="${DIFFUSERS_REF:-122b1e11}"
VLLM_OMNI_REPO="${VLLM_OMNI_REPO:-https://github.com/vllm-project/vllm-omni.git}"
VLLM_OMNI_REF="${VLLM_OMNI_REF:-8484d85d1}"
IMAGE="${IMAGE:-runner-vllm-omni:${VLLM_OMNI_REF}}"

docker build \
  --build-arg "CUDA_IMAGE=$CUDA_IMAGE" \
  --build-arg "PYTHON_VERSION=$PYTHON_VERSION" \
  --build-arg "VLLM_VERSION=$VLLM_VERSION" \
  --build-arg "TORCH_VERSION=$TORCH_VERSION" \
  --build-arg "TORCH_CUDA=$TORCH_CUDA" \
  --build-arg "TRANSFORMERS_VERSION=$TRANSFORMERS_VERSION" \
  --build-arg "DIFFUSERS_REPO=$DIFFUSERS_REPO" \
  --build-arg "DIFFUSERS_REF=$DIFFUSERS_REF" \
  --build-arg "VLLM_OMNI_REPO=$VLLM_OMNI_REPO" \
  --build-arg "VLLM_OMNI_REF=$VLLM_OMNI_REF" \
  -t "$IMAGE" "$@" "$HERE"
echo "built $IMAGE" >&2
