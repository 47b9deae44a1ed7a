#!/usr/bin/env bash
# Issue 17 on the H200, in one device call (under 8 minutes): `runner examples/h200.toml` with `repeats = 1`
# (the embedded default at full size: one H200 emulating a 24 GiB and a 16 GiB card by a real whole-device
# cap), so the findings are read from real CUDA OOMs: PyTorch's own message (allocated /
# reserved-but-unallocated, the per-process cap) and the refserver's real traceback. Writes report.md (its
# Findings sections), verdict.json, profiles.json, the console, each OOM's failure record and a short summary
# into $OUT.
#
#   bash benchmarks/h200_fidelity.sh prep        # HERE, once: the cp312 wheels the device lacks -> .whl/h200/
#   bash benchmarks/h200_findings.sh             # ON THE DEVICE (carry .whl)
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/h200_fidelity.sh
source benchmarks/h200_fidelity.sh  # prep/setup: the wheels, PYTHONPATH, $OUT, $SUMMARY
setup
budget=${BUDGET:-420}  # SIGINT at the deadline keeps every finished step and writes a partial report
results=/tmp/h200-findings-results
# examples/h200.toml as it is, but each request sent once (`repeats = 1`; the first step of each session is
# still sent twice for the determinism check): with the default two timed sends its 32 requests take about
# 9 minutes, more than one device call. Reference paths made absolute for the copy in /tmp.
matrix=/tmp/h200-findings.toml
sed -e 's|^\[run\]$|[run]\nrepeats = 1|' -e "s|\"refs/|\"$PWD/examples/refs/|g" examples/h200.toml >"$matrix"
timeout -s INT -k 20 "$budget" python3 -m runner "$matrix" --results "$results" --no-progress \
    >"$OUT/console.txt" 2>&1
echo "runner exit: $?" >>"$OUT/console.txt"
run=$(ls -d "$results"/h200-* 2>/dev/null | tail -1)
[ -n "$run" ] || { echo "no run directory" >>"$SUMMARY"; cat "$SUMMARY" "$OUT/console.txt"; exit 1; }
python3 -m runner report "$run" >>"$OUT/console.txt" 2>&1
cp "$run/report.md" "$run/verdict.json" "$run/profiles.json" "$run/run.json" "$OUT/" 2>>"$SUMMARY"
mkdir -p "$OUT/plots" && cp "$run"/plots/*-capacity.png "$OUT/plots/" 2>/dev/null
python3 - "$run" "$OUT" >>"$SUMMARY" 2>&1 <<'PY'
import json, pathlib, sys
run, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
ooms = {}
for p in sorted(run.glob("*/*/refs-*/*.json")) + sorted(run.glob("*/*/session.json")):
    d = json.loads(p.read_text())
    fails = [d.get("failure")] + [s.get("failure") for s in d.get("starts", [])]
    for f in fails:
        if f and f.get("oom"):
            ooms[d["key"]] = f["oom"]
(out / "oom-records.json").write_text(json.dumps(ooms, indent=1))
for v in json.loads((run / "verdict.json").read_text())["verdicts"]:
    f = v.get("findings") or {}
    print(f"{v['card']}: {v['world']} ({v.get('flags')}); functional {f.get('functional', {}).get('works')}")
    for c in f.get("contribution_sites", []):
        print(f"  site {c['site']} in {c['function']}: {c['flag_sets']} at {c['references']}, tried {c['tried_bytes']}")
    for name, fs in f.get("flag_sets", {}).items():
        m = fs["memory"]
        gib = lambda b: "?" if b is None else f"{b / 2**30:.3f} GiB"
        oom = m.get("oom") or {}
        print(f"  {name}: per reference {gib(m['per_reference_bytes'])} over {m['points']} counts "
              f"(worst residual {gib(m['worst_residual_bytes'])}), predicted {gib(m['predicted_peak_bytes'])} "
              f"({m['predicted_from']}) vs {gib(m['capacity_bytes'])} ({m['capacity_source']}): "
              f"shortfall {gib(m['shortfall_bytes'])}; oom {oom.get('site')} at {oom.get('references')} "
              f"allocated {gib(oom.get('allocated_bytes'))} reserved-unallocated {gib(oom.get('reserved_unallocated_bytes'))}")
print(f"{len(ooms)} OOM failure records with anatomy")
rows = [ln for ln in (run / "report.md").read_text().splitlines() if ln.startswith("| ") and " | **" in ln]
print("summary table 'why' cells:", [len(r.rstrip(" |").split(" | ", 3)[-1]) for r in rows], "characters")
PY
tar czf "$OUT/h200-findings-run.tar.gz" --exclude='refs-*/*.png' --exclude='plots' -C "$results" . 2>>"$SUMMARY"
cat "$SUMMARY"; tail -5 "$OUT/console.txt"
