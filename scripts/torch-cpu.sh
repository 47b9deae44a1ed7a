# Sourced by setup.sh and omni-stand.sh: `install_cpu_torch VENV` puts the CPU build of torch into VENV, unless a
# torch is already there. On Linux PyPI's torch is a multi-GB CUDA build, so the CPU build comes from PyTorch's CPU
# index when it answers within seconds, else torch==2.13.0 from the configured sources (a local CPU wheel where a
# machine keeps one; plain PyPI has no CPU build for Linux, so there pip falls back to the CUDA one).
torch_version="2.13.0"
install_cpu_torch() {
    local venv="$1"
    local pip=("$venv/bin/pip" install -q --disable-pip-version-check --no-compile)
    local cpu_index="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
    if "$venv/bin/python" -c "import torch" 2>/dev/null; then
        :  # keep whatever torch is already there (rerun, or one installed by hand for this machine's CUDA)
    elif "$venv/bin/python" -c "import urllib.request as u; u.urlopen('$cpu_index/torch/', timeout=5)" 2>/dev/null \
        && "${pip[@]}" --timeout 15 --retries 1 --extra-index-url "$cpu_index" "torch==$torch_version"; then
        :  # the index's 2.13.0+cpu sorts above the configured index's 2.13.0, so pip takes the CPU build
    else
        "${pip[@]}" "torch==$torch_version"
    fi
}
