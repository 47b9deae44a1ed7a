#!/usr/bin/env bash
# Issue 10 on the H200, in one device call: the reusable pinned pool (--cond-cache host) before/after, the
# whole-device cap (the CUDA context inside --vram-gib) before/after, and examples/seed-emulated-h200.toml
# (matrix.toml's flag sets on the 24/16 GiB emulated cards) with the NVML peak of each card checked against
# its capacity. Everything it finds goes to $OUT (at most 8 files).
#
#   bash benchmarks/h200_fidelity.sh prep        # HERE, once: cp312 wheels the device lacks -> .whl/h200/
#   bash benchmarks/h200_fidelity.sh [all]       # ON THE DEVICE (carry .whl): bench, then the example
#   bash benchmarks/h200_fidelity.sh bench|seed|capseed  # one part only (e.g. a second call if `all` ran out of time)
#   SEED_BUDGET_S=400 bash benchmarks/h200_fidelity.sh seed   # the example alone within an 8-minute call
#                                                             # (issue 19: the emulated 5080, one model on both)
#   bash benchmarks/h200_fidelity.sh auto        # ON THE DEVICE: the example alone under repeats = "auto" (issue 21),
#                                                # 440 s for the run, within 9 minutes in all; report.md -> $OUT
#
# The device has python3.12 and torch (CUDA) but no fastapi/uvicorn/pydantic/docker/jsonschema and no
# registry: `prep` downloads those wheels here (versions of this checkout's venv), the device installs them
# with --no-index into a folder of its own. A device command runs at most 600 s: `all` gives the example
# whatever the benchmarks left (SIGINT at the deadline keeps every finished step; the report is rewritten).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl/h200
# Not typing-extensions: the device's anyio needs its own newer one (`sentinel`, 2026-12-06)
PKGS=(fastapi starlette pydantic pydantic-core annotated-types typing-inspection uvicorn h11
      click python-multipart opentelemetry-api importlib-metadata zipp docker requests urllib3 jsonschema
      jsonschema-specifications referencing rpds-py attrs
      diffusers safetensors regex filelock)  # --arch qwen-image (the device's own huggingface_hub, kept for its transformers)

prep() {
    local py=${PY:-}
    [ -n "$py" ] || for c in .venv/bin/python /work/main/.venv/bin/python python3; do
        command -v "$c" >/dev/null && { py=$c; break; }; done
    mkdir -p "$WHEELS"
    local freeze; freeze=$("$py" -m pip freeze 2>/dev/null | tr 'A-Z_' 'a-z-')
    for p in "${PKGS[@]}"; do
        local v; v=$(grep -E "^${p}==" <<<"$freeze" | head -1)
        "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --abi cp312 --abi abi3 --abi none --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform manylinux_2_28_x86_64 --platform any -d "$WHEELS" "${v:-$p}" || echo "prep: no wheel for ${v:-$p}"
    done
    ls "$WHEELS"; du -sh "$WHEELS"
}

setup() {
    OUT=${OUT:-/tmp/h200-fidelity-out}; mkdir -p "$OUT"
    SITE=/tmp/h200-site
    python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl 2>&1 | tail -2 ||
        python3 -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" \
            "$SITE" "$WHEELS"/*.whl  # no pip there: a wheel is a zip of its site-packages files
    export PYTHONPATH="$PWD:$SITE" PYTHONUNBUFFERED=1
    SUMMARY="$OUT/summary.txt"
    { date -u; nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
      python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"
      python3 -c "import fastapi, uvicorn, pydantic, multipart, jsonschema, docker, psutil, pynvml, skimage, \
matplotlib, rich, prometheus_client; print('imports ok')"; } >>"$SUMMARY" 2>&1
}

bench() {
    # The CUDA unit checks of the engine (pool reuse, fp8, whole-device cap), when pytest is there.
    if python3 -c "import pytest" 2>/dev/null; then
        timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/refserver/test_cuda.py -m "not slow" \
            >"$OUT/test-cuda.txt" 2>&1; echo "test_cuda exit $?" >>"$SUMMARY"
    else echo "no pytest on the device: tests/refserver/test_cuda.py not run" >>"$SUMMARY"; fi
    # Item 9: the host conditioning cache, one pinned allocation per request vs the reusable pool
    # (the earlier H200 run: 29.4 GiB host peak, 5.5-13.8 s per request at 4 refs, 1024x1024, 8 steps).
    python3 benchmarks/refserver.py --device cuda --preset h200-24g --steps 8 --size 1024x1024 --refs 4 \
        --repeats 5 --modes host --server-args "--vram-gib 24" --variants "before=--no-pinned-pool;after=" \
        >"$OUT/pinned-pool.txt" 2>&1
    cap
}

cap() {
    # Item 8: NVML's whole-device figure under a 24 GiB cap, allocator-only cap vs whole-device cap
    # (the earlier run: 24.64 GiB seen on a "24 GiB" card at the 3-reference OOM).
    python3 benchmarks/refserver.py --device cuda --preset h200-24g --steps 8 --size 1024x1024 --refs 2,3 \
        --repeats 1 --modes device --server-args "--vram-gib 24" \
        --variants "allocator=--cap-scope allocator;whole-device=--cap-scope whole-device" \
        >"$OUT/whole-device.txt" 2>&1
}

seed() {
    local budget=${1:-560}
    local results=/tmp/h200-fidelity-results
    timeout -s INT -k 20 "$budget" python3 -m runner examples/seed-emulated-h200.toml --results "$results" \
        --no-progress >"$OUT/seed-emulated-h200.txt" 2>&1
    echo "runner exit: $?" >>"$OUT/seed-emulated-h200.txt"
    local run; run=$(ls -d "$results"/seed-emulated-h200-* 2>/dev/null | tail -1)
    [ -n "$run" ] || { echo "no run directory" >>"$SUMMARY"; return; }
    python3 -m runner report "$run" >>"$OUT/seed-emulated-h200.txt" 2>&1
    cp "$run/report.md" "$run/verdict.json" "$OUT/" 2>/dev/null
    python3 - "$run" >>"$SUMMARY" 2>&1 <<'EOF'
import json, pathlib, sys
run = pathlib.Path(sys.argv[1])
cap = {"rtx3090": 24, "rtx5080": 16}
for card, gib in cap.items():
    peaks = []
    for p in run.glob(f"{card}/*/refs-*/*.json"):
        s = json.loads(p.read_text())
        peaks += [(q["bytes"], s["key"], s["status"]) for q in s["peaks"] if q["source"] == "nvml" and q["available"]]
    for p in run.glob(f"{card}/*/session.json"):
        s = json.loads(p.read_text())
        for start in s["starts"]:
            peaks += [(q["bytes"], s["key"] + " (load)", "load") for q in start["load_peaks"]
                      if q["source"] == "nvml" and q["available"]]
    verdicts = json.loads((run / "verdict.json").read_text())["verdicts"] if (run / "verdict.json").exists() else []
    v = next((x for x in verdicts if x["card"] == card), None)
    starts = [json.loads(p.read_text()) for p in run.glob(f"{card}/*/session.json")]
    at_load = sorted(s["flags"] for s in starts if s["starts"] and (s["starts"][0].get("failure") or {}).get("kind")
                     == "oom_at_load")
    print(f"{card}: verdict {v['world'] if v else 'none'}; out of memory at load under "
          f"{len(at_load)} of {len(starts)} flag set(s) started{': ' + ', '.join(at_load) if at_load else ''}")
    if not peaks:
        print(f"{card}: no NVML peaks recorded"); continue
    b, key, status = max(peaks)
    verdict = "within" if b <= gib * 2**30 else "OVER"
    print(f"{card}: NVML whole-device peak {b / 2**30:.2f} GiB ({key}, {status}) {verdict} {gib} GiB "
          f"over {len(peaks)} windows")
EOF
    tar czf "$OUT/seed-emulated-h200.tar.gz" --exclude='refs-*/*.png' -C "$results" . 2>>"$SUMMARY"
}

[ "${BASH_SOURCE[0]}" = "$0" ] || return 0  # sourced (benchmarks/h200_findings.sh): the functions only
case "${1:-all}" in
    prep) prep ;;
    bench) setup; bench; cat "$OUT"/pinned-pool.txt "$OUT"/whole-device.txt | grep '^|' ;;
    seed) setup; seed "${SEED_BUDGET_S:-570}"; cat "$SUMMARY" ;;
    auto) setup; seed 440; cat "$SUMMARY"; sed -n '/^| card | verdict/,/^$/p;/^## What the run cost/,$p' "$OUT/report.md" ;;
    capseed) setup; cap; seed $((570 - SECONDS)); cat "$SUMMARY"; grep -h '^|' "$OUT"/whole-device.txt ;;
    all) setup; bench; left=$((570 - SECONDS)); [ "$left" -gt 30 ] || left=30; seed "$left"; cat "$SUMMARY"; grep -h '^|' "$OUT"/pinned-pool.txt "$OUT"/whole-device.txt ;;
    *) echo "usage: $0 prep|all|bench|seed|capseed|auto" >&2; exit 2 ;;
esac
