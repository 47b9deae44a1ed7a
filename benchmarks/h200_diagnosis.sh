#!/usr/bin/env bash
# Issue 27 on the H200, in one device call (under 9 minutes): `runner examples/h200.toml` with `repeats = 1`
# and the diagnosis pass at its default (`[run] diagnosis = "oom"`): every flag set decided by a real CUDA OOM
# gets one more start of the reference server with vLLM-Omni's --profiler-config, POST /start_profile, the
# deciding request once more, POST /stop_profile; the OOM observer's allocator snapshot is read into
# findings.flag_sets.<name>.memory.held. Brings back report.md, verdict.json, the held-memory plots, the
# console, the diagnosis records and a summary.
#
#   bash benchmarks/h200_fidelity.sh prep        # HERE, once: the cp312 wheels the device lacks -> .whl/h200/
#   bash benchmarks/h200_diagnosis.sh            # ON THE DEVICE (carry .whl)
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/h200_fidelity.sh
source benchmarks/h200_fidelity.sh  # prep/setup: the wheels, PYTHONPATH, $OUT, $SUMMARY
setup
budget=${BUDGET:-470}  # SIGINT at the deadline keeps every finished step and writes a partial report
results=/tmp/h200-diagnosis-results
matrix=/tmp/h200-diagnosis.toml
sed -e 's|^\[run\]$|[run]\nrepeats = 1|' -e "s|\"refs/|\"$PWD/examples/refs/|g" examples/h200.toml >"$matrix"
start=$(date +%s)
timeout -s INT -k 20 "$budget" python3 -m runner "$matrix" --results "$results" --no-progress \
    >"$OUT/console.txt" 2>&1
echo "runner exit: $? after $(( $(date +%s) - start )) s" >>"$OUT/console.txt"
run=$(ls -d "$results"/h200-* 2>/dev/null | tail -1)
[ -n "$run" ] || { echo "no run directory" >>"$SUMMARY"; cat "$SUMMARY" "$OUT/console.txt"; exit 1; }
python3 -m runner report "$run" >>"$OUT/console.txt" 2>&1
cp "$run/report.md" "$run/verdict.json" "$OUT/" 2>>"$SUMMARY"
mkdir -p "$OUT/plots" && cp "$run"/plots/*-held.png "$OUT/plots/" 2>>"$SUMMARY"
python3 - "$run" "$OUT" >>"$SUMMARY" 2>&1 <<'PY'
import json, pathlib, sys
run, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
diags = [json.loads(p.read_text()) for p in sorted(run.glob("*/*/diagnosis*.json"))]
(out / "diagnosis-records.json").write_text(json.dumps(diags, indent=1))
for d in diags:
    snap = run / d["snapshot"] if d.get("snapshot") else None
    print(d["key"], d["at"], d["references"], d["outcome"], f"total {d['total_s']} s start {d['start_s']} "
          f"request {d['request_s']}", d.get("snapshot"), snap.stat().st_size if snap else None, d.get("why_none"))
gib = lambda b: "?" if b is None else f"{b / 2**30:.3f} GiB"
for v in json.loads((run / "verdict.json").read_text())["verdicts"]:
    for name, fs in (v.get("findings") or {}).get("flag_sets", {}).items():
        h = fs["memory"].get("held")
        if h:
            print(f"{v['card']}/{name}: at {h['at']} {h['references']} refs ({h['how']}): active {gib(h['active_bytes'])} "
                  f"resident {gib(h['resident_bytes'])} request {gib(h['request_bytes'])} inactive "
                  f"{gib(h['inactive_bytes'])} tried {gib(h['tried_bytes'])}")
            for s in h["by_site"][:6]:
                print(f"    {s['phase']:8s} {gib(s['bytes'])} {s['blocks']:4d}  {s['site']} in {s['function']}")
            for n in h["named"]:
                print(f"    named {n['name']}: {gib(n['bytes'])} ({n['phase']})")
            for c in h["counterfactuals"]:
                print(f"    move {c['move']}: frees {gib(c['frees_bytes'])} vs shortfall {gib(c['shortfall_bytes'])}: {c['enough']}")
        elif fs["memory"].get("no_held"):
            print(f"{v['card']}/{name}: {fs['memory']['no_held']['why']}")
PY
cat "$SUMMARY"; tail -8 "$OUT/console.txt"
