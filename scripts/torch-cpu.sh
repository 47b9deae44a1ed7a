# Sourced by setup.sh, omni-stand.sh and docker/omni-stand/build.sh: `install_cpu_torch VENV` puts the CPU build of
# torch into VENV, unless a torch is already there; `download_cpu_torch DIR` puts the same wheel into a wheelhouse. On
# Linux PyPI's torch is a multi-GB CUDA build, so the CPU build comes from PyTorch's CPU index when it answers within
# seconds, else torch==2.13.0 from the configured sources (a local CPU wheel where a machine keeps one; plain PyPI has
# no CPU build for Linux, so there pip falls back to the CUDA one).
torch_version="2.13.0"

# The pip arguments that reach the CPU build (one per line; none when the CPU index does not answer).
cpu_torch_source() {
    local python="$1" cpu_index="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
    if "$python" -c "import urllib.request as u; u.urlopen('$cpu_index/torch/', timeout=5)" 2>/dev/null; then
        # the index's 2.13.0+cpu sorts above the configured index's 2.13.0, so pip takes the CPU build
        printf '%s\n' --timeout 15 --retries 1 --extra-index-url "$cpu_index"
    fi
}

install_cpu_torch() {
    local venv="$1"
    local pip=("$venv/bin/pip" install -q --disable-pip-version-check --no-compile)
    local source
    if "$venv/bin/python" -c "import torch" 2>/dev/null; then
        return  # keep whatever torch is already there (rerun, or one installed by hand for this machine's CUDA)
    fi
    mapfile -t source < <(cpu_torch_source "$venv/bin/python")
    # a CPU index that answered the probe but failed the install: the configured sources, as where it does not answer
    "${pip[@]}" "${source[@]}" "torch==$torch_version" || { [ ${#source[@]} -gt 0 ] && "${pip[@]}" "torch==$torch_version"; }
}

# The wheel alone (its dependencies are pinned with the rest where a wheelhouse is made: stand/requirements.txt).
download_cpu_torch() {
    local dir="$1" python="${2:-python3}"
    local source
    mapfile -t source < <(cpu_torch_source "$python")
    "$python" -m pip download -q --disable-pip-version-check --no-deps -d "$dir" "${source[@]}" "torch==$torch_version" \
        || { [ ${#source[@]} -gt 0 ] && "$python" -m pip download -q --disable-pip-version-check --no-deps -d "$dir" \
                 "torch==$torch_version"; }
}
