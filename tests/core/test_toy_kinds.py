"""A new meter and a new backend are one registry entry each: this test adds a toy meter and a toy backend
through runner.core.registry alone (no other file of the runner edited), and runs a whole session with them in
process — matrix validation of their card keys, the plan, the executor, the records, the verdict and the
report's glossary all reach them through their entries."""

from __future__ import annotations

import base64
import io
import json
import re
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from runner.app import finish
from runner.backends.base import ExitInfo, RunningServer
from runner.core.errors import UserError
from runner.core.records import RunRecord, Status, load
from runner.core.registry import BACKENDS, METERS, BackendEntry, BackendOptions, MeterEntry, Options
from runner.core.units import MIB
from runner.meters.base import Meter, PolledMeter
from runner.plan.lanes import ServerPlan, describe, make_plan
from runner.plan.matrix import Card, load_matrix
from runner.present import runinfo
from runner.run.execute import RunContext, run_plan
from runner.run.store import RunStore


def png(seed: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 32), (40 + seed % 200, 120, 200)).save(out, "PNG")
    return out.getvalue()


class ToyServer(RunningServer):
    """A server in this process: a thread answering /health and chat completions with a PNG."""

    requests = 0
    argv: tuple[str, ...] = ()

    def start(self) -> None:
        toy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200 if self.path == "/health" else 404)
                self.end_headers()

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                toy.requests += 1
                time.sleep(0.2)  # long enough for the toy meter (20 Hz) to sample inside every request
                with toy.log_path.open("a") as log:
                    log.write(f"request {toy.requests}\n")
                image = base64.b64encode(png(body["extra_body"]["seed"])).decode()
                answer = {"choices": [{"message": {"content": [
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}]}}]}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]  # the backend decides the port
        self.argv, _ = self.command(self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text(f"toy server for {self.plan.options.model_dump()}\n")
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def exited(self) -> ExitInfo | None:
        return None

    def stop(self) -> None:
        if hasattr(self, "http"):
            self.http.shutdown()
            self.http.server_close()

    def info(self) -> dict[str, Any]:
        return {"toy": True, "argv": list(self.argv)}


class ToyBackendOptions(BackendOptions):
    toy_site: str = "here"

    def where(self) -> str:
        return f"toy at {self.toy_site}"


class ToyMeterOptions(Options):
    toy_level_mib: int  # what the toy meter reads: this many MiB while the server has served a request


class ToyMeter(PolledMeter):
    def __init__(self, level_mib: int, server: ToyServer, hz: float) -> None:
        super().__init__("toy", "device", hz)
        self.level, self.server = level_mib, server

    def read(self) -> int:
        return self.level * MIB if self.server.requests else 0


def toy_meter(card: Card, server: RunningServer | None, hz: float) -> Meter:
    options = card.meter_options["toy"]
    assert isinstance(options, ToyMeterOptions) and isinstance(server, ToyServer)
    return ToyMeter(options.toy_level_mib, server, hz)


def toy_line(server: ServerPlan) -> str:
    return f"toy server at {server.options.where()}"


@pytest.fixture
def toys() -> Iterator[None]:
    meter = MeterEntry("toy", toy_meter, "device", 0, "a toy's whole-device figure, for the registry test",
                       max_hz=50, options=ToyMeterOptions)
    backend = BackendEntry("toy", ToyServer, ToyBackendOptions, "127.0.0.1", "a thread of the test process",
                           start_line=toy_line)
    with METERS.added(meter), BACKENDS.added(backend):
        yield


MATRIX = """
[run]
name = "toy"
seeds = [1]
steps = 2
size = "32x32"
repeats = 2

[servers.toy]
command = ["toy-server", "--port", "{port}", "--host", "{host}"]

[cards.toycard]
server = "toy"
backend = "toy"
toy_site = "the lab"
meters = ["toy"]
toy_level_mib = 3
vram_gib = 1

[flags.default]
role = "default"

[fixtures.pair]
prompt = "two toys"
references = ["refs/a.png", "refs/b.png"]

[matrix]
references = [1, 2]
"""


def test_a_toy_meter_and_backend_run_a_session_through_their_entries(toys: None, matrix_dir: Path) -> None:
    path = matrix_dir / "toy.toml"
    path.write_text(textwrap.dedent(MATRIX))
    matrix = load_matrix(path)
    card = matrix.cards["toycard"]
    assert card.options == ToyBackendOptions(toy_site="the lab")
    assert card.meter_options["toy"] == ToyMeterOptions(toy_level_mib=3)
    plan = make_plan(matrix)
    assert "toy at the lab" in describe(plan, matrix) and "toy server at toy at the lab" in describe(plan, matrix)

    store = RunStore(matrix_dir / "results" / "toy-run")
    store.write_run(load(RunRecord, runinfo.run_doc(matrix, plan, "toy-run", time.time())).model_dump(mode="json"))
    run_plan(RunContext(matrix, plan, store, "toy-run"))

    steps = {s.key: s for s in store.load_steps()}
    assert [s.status for s in steps.values()] == [Status.OK, Status.OK]
    one = steps["toycard/default/refs-1/pair-seed-1"]
    peak = one.peaks[0]
    assert (peak.source, peak.available) == ("toy", True) and peak.bytes == 3 * MIB and peak.samples > 0
    assert one.deterministic is True and len(one.wall_samples_s) == 2
    session = store.load_sessions()[0]
    assert session.backend == "toy" and session.starts[0].ready_s is not None
    assert session.starts[0].info["toy"] is True and session.starts[0].info["argv"][2].isdigit()
    assert session.meters[0]["source"] == "toy" and session.meters[0]["target_hz"] == 20

    verdicts = finish(store, matrix, rescore=False)
    assert [v.world for v in verdicts] == ["fits-resident"]
    report = (store.root / "report.md").read_text()
    assert "a toy's whole-device figure, for the registry test" in report


def test_a_toy_entrys_card_keys_are_validated_by_its_model(toys: None, matrix_dir: Path) -> None:
    path = matrix_dir / "toy.toml"
    path.write_text(textwrap.dedent(MATRIX).replace("toy_level_mib = 3\n", ""))
    required = "key 'cards.toycard.toy_level_mib' is required when meters includes 'toy'"
    with pytest.raises(UserError, match=re.escape(required)):
        load_matrix(path)
    path.write_text(textwrap.dedent(MATRIX).replace("toy_level_mib = 3", 'toy_level_mib = "3"'))
    wrong = "key 'cards.toycard.toy_level_mib' must be an integer, got '3'"
    with pytest.raises(UserError, match=re.escape(wrong)):
        load_matrix(path)


def test_without_the_entries_the_toy_names_are_unknown(matrix_dir: Path) -> None:
    path = matrix_dir / "toy.toml"
    path.write_text(textwrap.dedent(MATRIX))
    with pytest.raises(UserError, match=re.escape("key 'cards.toycard.backend' must be one of local, docker")):
        load_matrix(path)
