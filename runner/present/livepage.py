"""The live page `--metrics-port` serves beside /metrics: each card's device memory as a line that grows while
the run goes, its capacity, and the step it is on. For a user without Grafana: open
http://127.0.0.1:PORT/ in a browser (through an SSH tunnel from another machine).

Everything is served by the runner itself from 127.0.0.1: one HTML page whose script and style are inline (no
CDN, no external request: the Content-Security-Policy forbids them), and /live.json that it polls once a
second. Card and flag names come from the matrix, step lines can carry a server's failure text: the JSON holds
them inert (control characters escaped, bounded), and the page only ever sets them as textContent, never as
markup.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from typing import Any

from runner.core.records import SoakRequest, StepRecord
from runner.observe import quote
from runner.present.progress import soak_end_line, soak_line, step_line
from runner.run.pending import SOAK_ENDS

HISTORY = 7200  # readings kept per card: an hour at the memory ticker's 2 Hz
SERVED_POINTS = 600  # at most this many per card in one /live.json (bucket maxima: no peak is dropped)
TEXT_LIMIT = 300  # characters of one name or step line on the page
CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
       "img-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def text(value: object) -> str:
    """A name or a server's line as the page may show it: one line, control characters escaped, bounded."""
    return quote.bound(quote.console(value), TEXT_LIMIT)


def decimate(points: list[tuple[float, int]], limit: int) -> list[tuple[float, int]]:
    """At most `limit` points, each the maximum of its bucket (at its own time): a peak between two drawn
    points is never lost, which is what someone watching for an OOM needs."""
    if len(points) <= limit:
        return list(points)
    size = -(-len(points) // limit)
    return [max(points[i:i + size], key=lambda p: p[1]) for i in range(0, len(points), size)]


class LiveState:
    """What the page shows, fed by the exporter's events (several lane threads) and read by the HTTP thread."""

    def __init__(self, run_id: str, capacities: dict[str, int] | None = None) -> None:
        self.run_id = run_id
        self.capacities = dict(capacities or {})
        self._lock = threading.Lock()
        self._memory: dict[str, deque[tuple[float, int]]] = {}
        self._lane_of: dict[str, str] = {}
        self._planned: dict[str, int] = {}
        self._done: dict[str, int] = {}
        self._session: dict[str, str] = {}
        self._last: dict[str, str] = {}
        self._finished: set[str] = set()
        self._soaks: dict[str, int] = {}  # card → the requests its soak running now plans

    def lane_started(self, lane: str, cards: tuple[str, ...], total_steps: int) -> None:
        with self._lock:
            self._planned[lane] = total_steps
            self._done.setdefault(lane, 0)
            for card in cards:
                self._lane_of[card] = lane
                self._memory.setdefault(card, deque(maxlen=HISTORY))

    def session(self, card: str, words: str) -> None:
        with self._lock:
            self._session[card] = words

    def step_done(self, record: StepRecord) -> None:
        with self._lock:
            lane = self._lane_of.get(record.card, record.card)
            self._done[lane] = self._done.get(lane, 0) + 1
            self._last[record.card] = step_line(record)

    def soak_started(self, card: str, flags: str, done: int, planned: int) -> None:
        with self._lock:
            lane = self._lane_of.get(card, card)
            self._planned[lane] = self._planned.get(lane, 0) + planned - done
            self._soaks[card] = planned
            self._session[card] = f"{flags}: soak, {planned - done} request(s) to send"

    def soak_request(self, record: SoakRequest) -> None:
        card, flags = record.key.split("/", 1)
        with self._lock:
            lane = self._lane_of.get(card, card)
            self._done[lane] = self._done.get(lane, 0) + 1
            self._session[card] = f"{flags}: soak, request {record.number} of {self._soaks.get(card, '?')}"
            self._last[card] = soak_line(record)

    def soak_finished(self, card: str, flags: str, stopped: str | None, line: str | None, sent: int) -> None:
        with self._lock:
            lane = self._lane_of.get(card, card)
            if stopped in SOAK_ENDS:  # what it will never send is not left to do
                self._planned[lane] = self._planned.get(lane, 0) - (self._soaks.get(card, sent) - sent)
            self._session[card] = soak_end_line(card, flags, stopped, line, sent)

    def memory(self, card: str, device_bytes: int) -> None:
        with self._lock:
            self._memory.setdefault(card, deque(maxlen=HISTORY)).append((round(time.time(), 3), device_bytes))

    def lane_done(self, lane: str) -> None:
        with self._lock:
            self._finished.add(lane)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            cards = []
            for card in sorted(set(self._memory) | set(self._lane_of)):
                lane = self._lane_of.get(card, card)
                planned, done = self._planned.get(lane), self._done.get(lane, 0)
                if lane in self._finished:
                    step = f"lane finished: {done} of {planned} step(s)"
                elif planned is not None:
                    step = f"step {min(done + 1, planned)} of {planned} ({done} done)"
                else:
                    step = ""
                points = decimate(list(self._memory.get(card, ())), SERVED_POINTS)
                cards.append({"card": text(card), "lane": text(lane), "capacity_bytes": self.capacities.get(card),
                              "session": text(self._session.get(card, "")), "step": text(step),
                              "last_step": text(self._last.get(card, "")),
                              "t": [p[0] for p in points], "bytes": [p[1] for p in points]})
            return {"run": text(self.run_id), "now": round(time.time(), 3), "cards": cards}


def live_json(state: LiveState) -> bytes:
    """The snapshot as JSON with <, > and & escaped too: inert even if something renders it as HTML."""
    body = json.dumps(state.snapshot(), separators=(",", ":"))
    return body.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").encode()


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>runner — live VRAM</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:16px 20px;color:#1d232a;background:#f6f7f9}
h1{font-size:18px;margin:0 0 2px}
#status{color:#59636e;margin-bottom:12px}
#status.lost{color:#b42318;font-weight:600}
#cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:14px}
.card{background:#fff;border:1px solid #d8dde3;border-radius:8px;padding:10px 14px 8px}
.head{display:flex;justify-content:space-between;align-items:baseline;gap:12px}
.name{font-size:16px;font-weight:650}
.now{font-size:22px;font-weight:700;font-variant-numeric:tabular-nums}
.now.high{color:#b42318}
.facts{color:#3b444e;font-variant-numeric:tabular-nums}
.step{color:#3b444e;margin-top:2px}
.last{color:#59636e;font-size:12.5px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
svg{display:block;width:100%;height:190px;margin-top:6px}
.axis{stroke:#c4cad1;stroke-width:1}
.grid{stroke:#eceff2;stroke-width:1}
.tick{fill:#59636e;font-size:11px}
.cap{stroke:#b42318;stroke-width:1.5;stroke-dasharray:6 4}
.caplabel{fill:#b42318;font-size:11px}
.line{fill:none;stroke:#1f6feb;stroke-width:2}
.area{fill:#1f6feb;opacity:.12}
</style></head>
<body>
<h1>runner — live device memory per card</h1>
<div id="status">waiting for the first reading…</div>
<div id="cards"></div>
<script>
"use strict";
const NS = "http://www.w3.org/2000/svg";
const W = 640, H = 190, L = 64, R = 10, T = 10, B = 24;
function fmtBytes(v) {
  if (v === null || v === undefined) return "–";
  const units = [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
  for (const [name, div] of units) if (Math.abs(v) >= div) return (v / div).toFixed(2) + " " + name;
  return v + " B";
}
function fmtTick(v, unit) {
  const name = {[2 ** 30]: "GiB", [2 ** 20]: "MiB", [2 ** 10]: "KiB", 1: "B"}[unit];
  return +(v / unit).toFixed(2) + " " + name;
}
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
function svgEl(tag, attrs, text) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, String(attrs[k]));
  if (text !== undefined) e.textContent = text;
  return e;
}
function chart(c, now) {
  const svg = svgEl("svg", {viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", "data-points": c.bytes.length});
  const t0 = c.t.length ? Math.min(c.t[0], now - 60) : now - 60;
  const high = Math.max(c.capacity_bytes || 0, ...c.bytes, 1);
  const unit = [2 ** 30, 2 ** 20, 2 ** 10, 1].find(u => high >= u) || 1;
  const raw = high / unit / 4, mag = 10 ** Math.floor(Math.log10(raw));
  const stepV = ([1, 2, 2.5, 5, 10].find(m => m * mag >= raw) || 10) * mag * unit;  // round tick values
  const top = Math.max(stepV * Math.ceil(high * 1.04 / stepV), stepV);
  const x = t => L + (W - L - R) * (t - t0) / Math.max(now - t0, 1);
  const y = v => T + (H - T - B) * (1 - v / top);
  for (let v = 0; v <= top + stepV / 2; v += stepV) {
    svg.appendChild(svgEl("line", {class: "grid", x1: L, x2: W - R, y1: y(v), y2: y(v)}));
    svg.appendChild(svgEl("text", {class: "tick", x: L - 6, y: y(v) + 4, "text-anchor": "end"},
                          v === 0 ? "0" : fmtTick(v, unit)));
  }
  const span = now - t0;
  for (let i = 0; i <= 4; i++) {
    const t = t0 + span * i / 4, ago = Math.round(now - t);
    const label = ago === 0 ? "now" : (ago >= 120 ? Math.round(ago / 60) + " min ago" : ago + " s ago");
    svg.appendChild(svgEl("text", {class: "tick", x: x(t), y: H - 6,
                                   "text-anchor": i === 0 ? "start" : (i === 4 ? "end" : "middle")}, label));
  }
  svg.appendChild(svgEl("line", {class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B}));
  if (c.capacity_bytes) {
    svg.appendChild(svgEl("line", {class: "cap", x1: L, x2: W - R, y1: y(c.capacity_bytes), y2: y(c.capacity_bytes)}));
    svg.appendChild(svgEl("text", {class: "caplabel", x: W - R - 4, y: y(c.capacity_bytes) - 4, "text-anchor": "end"},
                          "capacity " + fmtBytes(c.capacity_bytes)));
  }
  if (c.bytes.length) {
    const pts = c.t.map((t, i) => `${x(t).toFixed(1)},${y(c.bytes[i]).toFixed(1)}`);
    const base = y(0).toFixed(1);
    svg.appendChild(svgEl("polygon", {class: "area",
      points: `${x(c.t[0]).toFixed(1)},${base} ${pts.join(" ")} ${x(c.t[c.t.length - 1]).toFixed(1)},${base}`}));
    svg.appendChild(svgEl("polyline", {class: "line", points: pts.join(" ")}));
  }
  return svg;
}
function render(d) {
  const box = document.getElementById("cards");
  const cards = d.cards.map(c => {
    const div = el("div", "card");
    div.dataset.card = c.card;
    const head = el("div", "head");
    head.appendChild(el("span", "name", c.card));
    const now = c.bytes.length ? c.bytes[c.bytes.length - 1] : null;
    const nowEl = el("span", "now", fmtBytes(now));
    if (now !== null && c.capacity_bytes && now > 0.9 * c.capacity_bytes) nowEl.classList.add("high");
    head.appendChild(nowEl);
    div.appendChild(head);
    const peak = c.bytes.length ? Math.max(...c.bytes) : null;
    let facts = "peak " + fmtBytes(peak);
    if (c.capacity_bytes) facts += " · capacity " + fmtBytes(c.capacity_bytes) +
      (peak !== null ? ` (peak ${(100 * peak / c.capacity_bytes).toFixed(0)} %)` : "");
    div.appendChild(el("div", "facts", facts));
    div.appendChild(el("div", "step", [c.session, c.step].filter(Boolean).join(" — ") || "not started"));
    div.appendChild(el("div", "last", c.last_step ? "last: " + c.last_step : ""));
    div.appendChild(chart(c, d.now));
    return div;
  });
  box.replaceChildren(...cards);
  const st = document.getElementById("status");
  st.className = "";
  st.textContent = `run ${d.run} · ${d.cards.length} card(s) · updated ${new Date(d.now * 1000).toLocaleTimeString()}`;
}
async function tick() {
  try {
    const r = await fetch("live.json", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
  } catch (e) {
    const st = document.getElementById("status");
    st.className = "lost";
    st.textContent = "no answer from the runner (" + e.message + "): the run has ended or its port is closed";
  }
}
tick();
setInterval(tick, 1000);
</script>
</body></html>
"""
