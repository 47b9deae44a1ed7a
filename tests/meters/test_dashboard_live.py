"""The VRAM dashboard, answered for real: a real Prometheus (1 s scrapes, on 127.0.0.1) scrapes the runner's
own exporter (`--metrics-port`), the NVML sidecar (real code) and a dcgm-exporter-shaped endpoint while a real
run of the embedded default's server goes (one card, one session); every panel's every query, read from
monitoring/grafana-vram-dashboard.json with its variables resolved as Grafana resolves them, is asked of
Prometheus's HTTP API during the run and must return a series whose values are what the run recorded
(memory.csv, the step records) within the scrape's resolution. The live page on the same port is opened in
headless Chromium in the same run.

The run is held open on purpose: the session's last request hangs (refserver `--fault hang@4`: request 4 is
refs-3, after refs-1's untimed determinism re-send), so "during the run" is a state the test waits for, not a
moment it hopes to catch; the test then ends that request by stopping the server, and the run finishes.
"""

from __future__ import annotations

import copy
import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
from grafana_vars import TimeRange, resolve, variable_query
from live_gpu import MIB, RESERVED_MIB, UUID, DcgmShapedExporter, RefserverSource
from meters_support import PrometheusServer, free_port

from runner.meters.sidecar import Sidecar

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "monitoring" / "grafana-vram-dashboard.json"
SCRAPE_S = 1.0
CAPACITY_MIB = 9  # the embedded default's cpu-roomy card
CARD = "cpu-roomy"
# A Prometheus point at evaluation time t holds the newest scrape at or before t (scraped up to one interval
# and some load-induced lateness earlier); the recorded series is compared over that stretch.
BEFORE_S, AFTER_S = 2 * SCRAPE_S + 0.5, 0.5
HOLD_S = 10.0  # seconds of 1 s scrapes kept during the hang before the panels are asked
HANG_LINE = "fault hang@4: this request will never return"  # the reference server's warning, in server.log

MATRIX = """
[run]
name = "live"
seeds = [2301]
steps = 2
size = "64x64"
request_timeout_s = 300                   # the hung request is ended by the test, never by this
ready_timeout_s = 240
results_dir = "results"
restarts = 0
sample_hz = 20

[servers.refserver]
command = ["{{python}}", "-m", "runner.refserver", "--host", "{{host}}", "--port", "{{port}}", "--preset", "tiny",
           "--vram-gib", "{{vram_gib}}", "--model", "{{model}}", "--fault", "hang@4"]
port = {server_port}
model = "refserver-tiny"

[cards.cpu-roomy]
server = "refserver"
vram_mib = 9.0
meters = ["sidecar", "dcgm", "server", "host"]
sidecar_url = "{sidecar_url}"
dcgm_url = "http://{dcgm}/metrics"

[flags.default]
role = "default"

[fixtures.shapes]
prompt = "Place the shapes from the reference images together on one table, in order."
references = ["{refs}/ref-1.png", "{refs}/ref-2.png", "{refs}/ref-3.png"]

[matrix]
references = [1, 2, 3]
"""


@dataclass
class LiveRun:
    proc: subprocess.Popen
    log: Path
    results: Path
    prom: PrometheusServer
    sidecar: Sidecar
    dcgm: DcgmShapedExporter
    metrics_port: int
    server_port: int
    t0: float  # when the run was started: the dashboard's "from"
    hung_at: float = 0.0
    sidecar_hz: list[tuple[float, float]] = field(default_factory=list)  # (t, the achieved rate it served)
    answers: dict = field(default_factory=dict)  # what Prometheus answered during the run

    @property
    def session_dir(self) -> Path:
        return next(self.results.glob(f"*/{CARD}/default"))

    def hanging(self) -> bool:
        """The run is alive and its hung request is still in flight (the server said so, nothing after)."""
        return self.proc.poll() is None and self.hung_at > 0 and not self.step_files(3)

    def step_files(self, refs: int | None = None) -> list[Path]:
        pattern = f"refs-{refs}/*.json" if refs else "refs-*/*.json"
        return sorted(self.session_dir.glob(pattern))

    def steps(self, until: float | None = None) -> list[dict]:
        out = [json.loads(p.read_text()) for p in self.step_files()]
        return [s for s in out if until is None or s["started_at"] + (s["wall_s"] or 0) <= until]

    def memory(self, source: str, until: float) -> list[tuple[float, int]]:
        with (self.session_dir / "memory.csv").open() as f:
            rows = [(float(r["t"]), int(r["bytes"])) for r in csv.DictReader(f)
                    if r["source"] == source and r["metric"] == "device"]
        return sorted(p for p in rows if p[0] <= until)

    def end_hang(self) -> int:
        """Stop the reference server this run started (found by its listening port among the run's own
        children): the hung request fails, the run writes its report and exits."""
        runner = psutil.Process(self.proc.pid)
        for child in runner.children(recursive=True):
            try:
                if any(c.laddr and c.laddr.port == self.server_port for c in child.net_connections("tcp")):
                    child.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        return self.proc.wait(240)


def wait_for(what: str, check: Callable[[], object], timeout_s: float, run: LiveRun | None = None) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        if run is not None and run.proc.poll() is not None:
            pytest.fail(f"the run ended (rc {run.proc.returncode}) before {what}:\n{run.log.read_text()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"timed out ({timeout_s:.0f} s) waiting for {what}" +
                (f":\n{run.log.read_text()[-3000:]}" if run else ""))


def prom_query(run: LiveRun, path: str, params: dict) -> list[dict]:
    r = httpx.get(f"{run.prom.url}/api/v1/{path}", params=params, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{params}: {body}"
    return body["data"] if path.startswith("label/") else body["data"]["result"]


@pytest.fixture(scope="module")
def live_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    if shutil.which("prometheus") is None:
        pytest.skip("the prometheus binary is missing (Debian: apt-get install -y prometheus)")
    tmp = tmp_path_factory.mktemp("live")
    server_port, metrics_port = free_port(), free_port()
    source = RefserverSource(server_port, CAPACITY_MIB * MIB)
    sidecar = Sidecar(source, hz=20).start()
    dcgm = DcgmShapedExporter(source, interval_s=0.5)
    matrix = tmp / "live.toml"
    matrix.write_text(MATRIX.format(server_port=server_port, sidecar_url=sidecar.url, dcgm=dcgm.target,
                                    refs=ROOT / "examples" / "refs"))
    jobs = {"dcgm-exporter": [dcgm.target], "runner-sidecar": [sidecar.url.removeprefix("http://")],
            "runner": [f"127.0.0.1:{metrics_port}"]}  # monitoring/prometheus.yml's job names
    prom = PrometheusServer(tmp, [], SCRAPE_S, jobs)
    # The sidecar answers a reader's first read with its newest sample alone: Prometheus must have read it once
    # before the run starts. Its first scrape comes seconds after its start, and on a fast machine the run's first
    # requests come before it: a peak then was the run's and not Prometheus's (7,203,660 B on the panel against
    # the run's 7,234,380, a peak 11 s before the panels were asked and 2 s before Prometheus's first sample).
    try:
        wait_for("Prometheus's first scrape of the sidecar", lambda: any(
            r["value"][1] == "1" for r in httpx.get(f"{prom.url}/api/v1/query", params={
                "query": 'up{job="runner-sidecar"}'}, timeout=10).json()["data"]["result"]), 30)
    except BaseException:
        prom.stop()
        sidecar.stop()
        dcgm.stop()
        raise
    log = tmp / "runner.log"
    t0 = time.time()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "runner", str(matrix), "--metrics-port", str(metrics_port),
                                 "--results", str(tmp / "results")], stdout=out, stderr=subprocess.STDOUT, env=env)
    run = LiveRun(proc, log, tmp / "results", prom, sidecar, dcgm, metrics_port, server_port, t0)
    # The achieved rate is a sawtooth (it climbs at each sample and sinks between them), so no poll of it
    # bounds what a scrape read at another moment: keep every value the sidecar served instead, the scrapes'
    # own included, as the dcgm-shaped endpoint keeps what it served.
    serve_info = sidecar.sampler.info

    def recording_info() -> dict:
        info = serve_info()
        run.sidecar_hz.append((time.time(), float(info["achieved_hz"])))
        return info

    sidecar.sampler.info = recording_info  # type: ignore[method-assign]
    try:
        def hung() -> bool:
            log = next(iter(run.results.glob(f"*/{CARD}/default/server.log")), None)
            return log is not None and HANG_LINE in log.read_text(errors="replace")

        wait_for(f"the hung request (server log: {HANG_LINE!r})", hung, 300, run)
        run.hung_at = time.time()
        # Prometheus has scraped the runner after the last finished step (its counters are current).
        done = len(run.steps())
        wait_for("a scrape of the runner's finished steps", lambda: any(
            float(r["value"][1]) == done for r in prom_query(run, "query", {"query": "sum(runner_steps_total)"})),
            15, run)
        # The hang holds the run open: on a fast machine it comes seconds after the start, too soon for the
        # panels' series to hold enough scrapes to compare. Let the hung request hold a few more.
        time.sleep(max(0.0, HOLD_S - (time.time() - run.hung_at)))
        yield run
    finally:
        if proc.poll() is None:
            proc.terminate()  # our own child: it stops the servers it started
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        prom.stop()
        sidecar.stop()
        dcgm.stop()


# ---- the panels' queries, as Grafana asks them ----------------------------------------------------------

def targets(dashboard: dict) -> list[tuple[dict, dict]]:
    return [(p, t) for p in dashboard["panels"] for t in p.get("targets", [])]


def ask_every_panel(run: LiveRun, dashboard: dict, end: float) -> dict[tuple[str, str], dict]:
    """Each target as Grafana queries it for the range [run start, end]: a range query at the panel's
    $__interval, with $gpu All and with the one GPU picked; every answer must hold a series with values."""
    tr = TimeRange(run.t0, end, min_interval_s=1.0, scrape_interval_s=SCRAPE_S)
    step = tr.interval_s
    start = math.floor(tr.start / step) * step
    out: dict[tuple[str, str], dict] = {}
    for panel, target in targets(dashboard):
        answers = {}
        for pick, selected in (("all", None), ("one", [UUID])):
            expr = resolve(target["expr"], dashboard, tr, {"gpu": selected})
            result = prom_query(run, "query_range", {"query": expr, "start": start, "end": end, "step": step})
            assert result and all(s["values"] for s in result), \
                f"panel {panel['title']!r} {target['refId']} ($gpu {pick}): {expr} returned no series during the run"
            answers[pick] = [{"labels": s["metric"], "points": [(float(t), float(v)) for t, v in s["values"]]}
                             for s in result]
        out[(panel["title"], target["refId"])] = {"panel": panel, "expr": target["expr"], **answers}
    return out


def ask_variables(run: LiveRun, dashboard: dict, end: float) -> dict[str, list[str]]:
    out = {}
    for var in dashboard["templating"]["list"]:
        metric, label = variable_query(var)
        out[var["name"]] = prom_query(run, f"label/{label}/values",
                                      {"match[]": metric, "start": run.t0, "end": end})
    return out


# ---- what the run recorded, and the comparisons ------------------------------------------------------------

def held(series: list[tuple[float, int]], a: float, b: float) -> list[int]:
    """The recorded step signal's values over [a, b]: the value in force at a, and every sample in (a, b]
    (memory.csv keeps change points: lossless for a step signal)."""
    before = [v for t, v in series if t <= a]
    return ([before[-1]] if before else []) + [v for t, v in series if a < t <= b]


def check_points(name: str, points: list[tuple[float, float]], series: list[tuple[float, int]],
                 to_recorded: Callable[[float], float], end: float,
                 highs: list[tuple[float, int]] | None = None) -> int:
    """Every point is a value the recorded series held within the scrape's resolution around it; with
    `highs` (maxima between polls of the same samples), a point sampled at another moment than the run's
    samples lies between the lowest recorded value and the highest maximum around it."""
    first = series[0][0] + BEFORE_S
    checked = 0
    for t, v in points:
        if t < first or t > end:
            continue
        a, b = t - BEFORE_S, t + AFTER_S
        values, got = held(series, a, b), to_recorded(v)
        if highs is None:
            assert any(math.isclose(got, r, rel_tol=1e-9, abs_tol=0.5) for r in values), \
                f"{name}: {v} at {t:.1f} is none of the recorded {sorted(set(values))} in [{a:.1f}, {b:.1f}]"
        else:
            top = held(highs, a, b)
            assert min(values) <= got <= max(top), \
                f"{name}: {v} at {t:.1f} is outside the recorded [{min(values)}, {max(top)}] in [{a:.1f}, {b:.1f}]"
        checked += 1
    assert checked >= 5, f"{name}: only {checked} point(s) overlap the recorded series: nothing was compared"
    return checked


def only(answer: dict, pick: str = "one") -> list[tuple[float, float]]:
    series = answer[pick]
    assert len(series) == 1, f"{answer['expr']}: {len(series)} series for one card: {[s['labels'] for s in series]}"
    return series[0]["points"]


def last(points: list[tuple[float, float]]) -> float:
    return points[-1][1]  # Grafana's stat: lastNotNull (a range query has no nulls)


@dataclass
class Recorded:
    dcgm: list[tuple[float, int]]  # bytes
    sidecar: list[tuple[float, int]]
    server: list[tuple[float, int]]
    steps: list[dict]
    collected: list[tuple[float, dict[str, float]]]  # what the dcgm endpoint served (util, power)
    sidecar_hz: list[tuple[float, float]]
    end: float
    dcgm_reserved: tuple[int, ...]  # the dcgm meter's reserved bytes (min, max), from session.json

    def served(self, field: str) -> list[tuple[float, int]]:
        return [(t, f[field]) for t, f in self.collected]


def mib(v: float) -> float:
    return v * MIB


def check_panel(key: tuple[str, str], answer: dict, rec: Recorded) -> None:
    """The value check of each panel target, named by (title, refId): a panel without one fails."""
    end = rec.end
    title, ref = key
    match key:
        case ("VRAM used now (DCGM)", "A") | ("VRAM used (DCGM)", "A"):
            check_points(title, only(answer), rec.dcgm, mib, end)
        case ("Peak VRAM, dashboard range (DCGM)", "A"):
            peak = last(only(answer)) * MIB
            longest = max(min(held(rec.dcgm, t, t + BEFORE_S)) for t, _ in rec.dcgm)  # held ≥ one scrape + slack
            assert longest <= peak <= max(v for _, v in rec.dcgm), (peak, longest, max(v for _, v in rec.dcgm))
        case ("Peak VRAM, dashboard range (sidecar NVML)", "A"):
            # both are maxima over the sidecar's own samples: Prometheus's between scrapes, the run's between
            # its polls; every sample of the session is in both
            assert last(only(answer)) == max(v for _, v in rec.sidecar)
        case ("Sidecar NVML sample rate", "A"):  # the sidecar's own figure, as served to each scrape
            check_points(title, only(answer), rec.sidecar_hz, float, end)
        case ("VRAM used (sidecar NVML): newest and max between scrapes", "A"):
            check_points(title + " (newest)", only(answer), rec.server, float, end, highs=rec.sidecar)
        case ("VRAM used (sidecar NVML): newest and max between scrapes", "B"):
            points = only(answer)
            assert max(v for _, v in points) == max(v for _, v in rec.sidecar)
            for t, v in points:
                assert v <= max(held(rec.sidecar, t - BEFORE_S - 1, t + AFTER_S) or [math.inf]), (t, v)
        case ("VRAM used share of the card (DCGM)", "A"):
            check_points(title, only(answer), rec.dcgm, lambda pct: pct * CAPACITY_MIB / 100 * MIB, end)
        case ("Free and driver-reserved (DCGM)", "A"):
            check_points(title + " (free)", only(answer), rec.dcgm,
                         lambda free: (CAPACITY_MIB - RESERVED_MIB - free) * MIB, end)
        case ("Free and driver-reserved (DCGM)", "B"):
            assert {v * MIB for _, v in only(answer)} == set(rec.dcgm_reserved)
        case ("GPU utilisation and power (DCGM)", "A"):  # the run records neither: what the endpoint served
            check_points(title + " (util)", only(answer), rec.served("DCGM_FI_DEV_GPU_UTIL"), float, end)
        case ("GPU utilisation and power (DCGM)", "B"):
            check_points(title + " (power)", only(answer), rec.served("DCGM_FI_DEV_POWER_USAGE"), float, end)
        case ("Runner: live device memory per card", "A"):
            series = answer["one"]
            assert [s["labels"]["card"] for s in series] == [CARD]
            check_points(title, series[0]["points"], rec.sidecar, float, end)  # the card's first meter
        case ("Runner: live device memory per card", "B"):
            got = {(s["labels"]["flags"], s["labels"]["references"], s["labels"]["source"]): last(s["points"])
                   for s in answer["one"]}
            want = {(s["flags"], str(s["references"]), p["source"]): float(p["bytes"]) for s in rec.steps
                    for p in [next(p for p in s["peaks"] if p["metric"] == "device" and p["available"])]}
            assert got == want
        case ("Runner: steps by outcome", "A"):
            got = {(s["labels"].get("card"), s["labels"].get("flags"), s["labels"].get("status"),
                    s["labels"].get("failure", "")): last(s["points"]) for s in answer["one"]}
            want = Counter((s["card"], s["flags"], s["status"], (s["failure"] or {}).get("kind", ""))
                           for s in rec.steps)
            assert got == {k: float(n) for k, n in want.items()}
        case _:
            pytest.fail(f"panel {title!r} target {ref} has no value check here: add one")


def recorded(run: LiveRun, end: float) -> Recorded:
    session = json.loads((run.session_dir / "session.json").read_text())
    reserved = next(m["reserved_bytes"] for m in session["meters"] if m["source"] == "dcgm")
    return Recorded(dcgm=run.memory("dcgm", end), sidecar=run.memory("sidecar", end),
                    server=run.memory("server", end), steps=run.steps(until=end),
                    collected=list(run.dcgm.collected), sidecar_hz=list(run.sidecar_hz), end=end,
                    dcgm_reserved=(reserved["min"], reserved["max"]))


# ---- the tests ------------------------------------------------------------------------------------------------

def test_live_page_in_headless_chromium(live_run: LiveRun, tmp_path: Path) -> None:
    """The runner's own page on --metrics-port, opened in a real browser during the run: the card's memory
    line is drawn from the run's readings, the step is named, and nothing is fetched from anywhere else."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_bin = shutil.which("chromedriver")
    if chromium is None or driver_bin is None:
        pytest.skip("headless Chromium is missing (Debian: apt-get install -y chromium chromium-driver; "
                    "scripts/services.sh installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is missing (pip install selenium)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1000,560", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_bin), options=options)
    try:
        url = f"http://127.0.0.1:{live_run.metrics_port}/"
        driver.get(url)
        points = wait_for("the page's VRAM line (≥ 10 points)", lambda: int(driver.execute_script(
            "const s = document.querySelector('.card svg'); return s ? +s.dataset.points : 0") or 0) >= 10, 30)
        assert points
        assert live_run.hanging(), "the run moved on before the page was read"
        # one read of the page as drawn now (it redraws every second, so elements are not held across calls)
        card = driver.execute_script(
            "const c = document.querySelector(`.card[data-card=\"${arguments[0]}\"]`);"
            "return c && {text: c.innerText, line: c.querySelector('polyline').getAttribute('points')}", CARD)
        assert card, f"no panel for card {CARD}"
        text = card["text"]
        assert "step 3 of 3 (2 done)" in text and "serving" in text, text
        assert "capacity 9.00 MiB" in text and "MiB" in text.split("\n")[1], text
        assert card["line"].count(",") >= 10
        fetched = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert fetched and all(u.startswith(url) for u in fetched), fetched  # live.json only, from the runner
        shot = Path(os.environ.get("LIVE_PAGE_SCREENSHOT", tmp_path / "live-page.png"))
        shot.parent.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(shot)), "no screenshot"
        print(f"screenshot: {shot}")
    finally:
        driver.quit()


def test_every_panel_query_answers_what_the_run_recorded(live_run: LiveRun) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert live_run.hanging(), "the run is not in its held request"
    end = time.time()
    answers = ask_every_panel(live_run, dashboard, end)  # during the run: each returns a series
    variables = ask_variables(live_run, dashboard, end)
    assert live_run.hanging(), "the run moved on while Prometheus was asked"
    assert variables == {"gpu": [UUID]}

    live_run.end_hang()  # the run's records are complete (memory.csv is flushed when the session ends)
    rec = recorded(live_run, end)
    assert [s["status"] for s in rec.steps] == ["ok", "ok"] and len(rec.dcgm) > 5 and len(rec.sidecar) > 5
    for key, answer in answers.items():
        check_panel(key, answer, rec)
    live_run.answers["checked"] = rec


def test_a_broken_panel_fails(live_run: LiveRun) -> None:
    """The check above can fail: a renamed metric returns nothing, a wrong label returns nothing for the
    picked GPU (while `All`'s .* still matches), a wrong grouping label loses the flag set's series, and a
    share that leaves out the driver-reserved part draws a line whose values the run never had."""
    if "checked" not in live_run.answers:
        pytest.skip("needs the answers of test_every_panel_query_answers_what_the_run_recorded")
    rec = live_run.answers["checked"]
    dashboard = json.loads(DASHBOARD.read_text())
    breaks = {
        "renamed metric": ("VRAM used (DCGM)", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_USED_MIB"),
        "wrong label": ("VRAM used now (DCGM)", 'UUID=~"$gpu"', 'uuid=~"$gpu"'),
        "wrong grouping": ("Runner: steps by outcome", "flags,", "flag,"),
        "wrong arithmetic": ("VRAM used share of the card (DCGM)", ' + DCGM_FI_DEV_FB_RESERVED{UUID=~"$gpu"})', ")"),
    }
    for why, (title, old, new) in breaks.items():
        broken = copy.deepcopy(dashboard)
        panel = next(p for p in broken["panels"] if p["title"] == title)
        assert old in panel["targets"][0]["expr"], (why, panel["targets"][0]["expr"])
        panel["targets"][0]["expr"] = panel["targets"][0]["expr"].replace(old, new)
        broken["panels"] = [panel]
        with pytest.raises(AssertionError):
            got = ask_every_panel(live_run, broken, rec.end)
            for key, answer in got.items():
                check_panel(key, answer, rec)
