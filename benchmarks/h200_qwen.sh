#!/usr/bin/env bash
# Issue 28 on the H200: the reference server's Qwen-Image engine (--arch qwen-image, diffusers'
# QwenImageTransformer2DModel at full width, 34 layers, bf16, random weights) on emulated 24 and 16 GiB cards.
#
#   bash benchmarks/h200_fidelity.sh prep     # HERE, once: the cp312 wheels the device lacks -> .whl/h200/
#   bash benchmarks/h200_qwen.sh sweep        # ON THE DEVICE (carry .whl): per-reference peaks and OOMs, in process
#   bash benchmarks/h200_qwen.sh capsweep     # ON THE DEVICE: the same under an allocator-only cap
#   bash benchmarks/h200_qwen.sh seed         # ON THE DEVICE: examples/seed-emulated-h200.toml through the runner
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/h200_fidelity.sh
source benchmarks/h200_fidelity.sh  # prep/setup: the wheels, PYTHONPATH, $OUT, $SUMMARY

sweep() {
    local s="$OUT/sweep.jsonl" py=benchmarks/qwen_image_sweep.py
    python3 "$py" h200-24g 24 --refs 1-7 >>"$s" 2>>"$OUT/sweep.err"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 "$py" h200-24g 24 --refs 1-7 -- \
        >>"$s" 2>>"$OUT/sweep.err"
    python3 "$py" h200-16g 16 --refs 1-1 >>"$s" 2>>"$OUT/sweep.err"
    python3 "$py" h200-24g 24 --refs 1-4 -- --enable-layerwise-offload >>"$s" 2>>"$OUT/sweep.err"
    python3 "$py" h200-24g 24 --refs 1-4 -- --quantization fp8 >>"$s" 2>>"$OUT/sweep.err"
    python3 "$py" h200-24g 24 --refs 1-5 --side 512 --steps 4 >>"$s" 2>>"$OUT/sweep.err"
    tail -5 "$OUT/sweep.err"
    cat "$s"
}

capsweep() {  # the cap on PyTorch's allocator alone (the shared data's set_per_process_memory_fraction)
    local s="$OUT/capsweep.jsonl" py=benchmarks/qwen_image_sweep.py
    python3 "$py" h200-24g 24 --refs 3-7 -- --cap-scope allocator >>"$s" 2>>"$OUT/sweep.err"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 "$py" h200-24g 24 --refs 3-7 -- --cap-scope allocator \
        >>"$s" 2>>"$OUT/sweep.err"
    cat "$s"
}

seed() {
    local budget=$1 results=/tmp/h200-qwen-results matrix=/tmp/seed-emulated-h200.toml
    sed -e "s|\"refs/|\"$PWD/examples/refs/|g" examples/seed-emulated-h200.toml >"$matrix"
    timeout -s INT -k 20 "$budget" python3 -m runner "$matrix" --results "$results" --no-progress \
        >"$OUT/console.txt" 2>&1
    echo "runner exit: $?" >>"$OUT/console.txt"
    local run; run=$(ls -d "$results"/seed-emulated-h200-* 2>/dev/null | tail -1)
    [ -n "$run" ] || { echo "no run directory" >>"$SUMMARY"; return 1; }
    python3 -m runner report "$run" >>"$OUT/console.txt" 2>&1
    cp "$run/report.md" "$run/verdict.json" "$OUT/" 2>>"$SUMMARY"
    tar czf "$OUT/seed-emulated-h200.tar.gz" --exclude='refs-*/*.png' -C "$results" . 2>>"$SUMMARY"
    tail -30 "$OUT/console.txt"
}

setup
case "${1:-sweep}" in
    sweep) sweep ;;
    capsweep) capsweep ;;
    seed) seed "${BUDGET:-540}" ;;
    *) echo "usage: $0 sweep|seed" >&2; exit 2 ;;
esac
