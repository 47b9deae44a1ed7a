#!/usr/bin/env bash
# Issue 45 on the GPU, in one device call: docs/evidence/h200-retention/matrix.toml through the runner (the
# reference server's Qwen-Image engine on CUDA: default, --cond-cache retain, --fault leak; a soak of two of them).
# Brings back report.md, verdict.json, the step and soak records, the soak plots, the kept diagnosis records and
# a summary of each step's floors (NVML upper bound beside the server's exact figure).
#
#   bash benchmarks/h200_fidelity.sh prep        # HERE, once: the cp312 wheels the device lacks -> .whl/h200/
#   bash benchmarks/h200_retention.sh            # ON THE DEVICE (carry .whl)
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/h200_fidelity.sh
source benchmarks/h200_fidelity.sh  # prep/setup: the wheels, PYTHONPATH, $OUT, $SUMMARY
setup
budget=${BUDGET:-520}  # SIGINT at the deadline keeps every finished step and writes a partial report
results=/tmp/h200-retention-results
start=$(date +%s)
timeout -s INT -k 20 "$budget" python3 -m runner docs/evidence/h200-retention/matrix.toml --results "$results" \
    --no-progress >"$OUT/console.txt" 2>&1
echo "runner exit: $? after $(( $(date +%s) - start )) s" >>"$OUT/console.txt"
run=$(ls -d "$results"/h200-retention* 2>/dev/null | tail -1)
[ -n "$run" ] || { echo "no run directory" >>"$SUMMARY"; cat "$SUMMARY" "$OUT/console.txt"; exit 1; }
python3 -m runner report "$run" >>"$OUT/console.txt" 2>&1
cp "$run/report.md" "$run/verdict.json" "$OUT/" 2>>"$SUMMARY"
# At most 8 files come back: the plots and every record but the images in one archive
(cd "$run" && find . \( -name '*.json' -o -name '*.jsonl' -o -name '*.png' -o -name '*.log' -o -name '*.md' -o -name '*.pickle' \) -path './*' \
    ! -path './*/*/refs-*/*.png' ! -path './*/*/soak/*.png' -size -12M -print0 | tar --null -T - -czf "$OUT/run.tgz")
python3 - "$run" >>"$SUMMARY" 2>&1 <<'PY'
import json, pathlib, sys
run = pathlib.Path(sys.argv[1])
gib = lambda b: "-" if b is None else f"{b / 2**30:.3f}"
levels = lambda ls: " ".join(f"{l['source']}={gib(l['bytes'])}({l['bound']})" for l in ls)
steps = [json.loads(p.read_text()) for p in run.glob("*/*/refs-*/*.json")]
for r in sorted(steps, key=lambda r: r["started_at"] or ""):
    print(r["flags"], r["references"], r["status"], r["wall_s"], "before:", levels(r["floor_before"]),
          "after:", levels(r["floor_after"]), "peak:", r.get("server_peak_mib"))
for v in json.loads((run / "verdict.json").read_text())["verdicts"]:
    print(v["card"], v.get("world"), v.get("reason"))
    for name, fs in (v.get("findings") or {}).get("flag_sets", {}).items():
        print(" ", name, "retention", json.dumps(fs.get("retention")))
        print(" ", name, "speed", json.dumps(fs.get("speed"))[:600])
        print(" ", name, "soak", json.dumps(fs.get("soak"))[:600])
PY
cat "$SUMMARY"; tail -30 "$OUT/console.txt"
