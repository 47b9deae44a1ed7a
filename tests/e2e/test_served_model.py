"""A matrix whose `model` is not what the server serves (issue 44, 8a), against the reference server speaking
vLLM-Omni 0.30 (`--api 0.30 --served-model-name served-x`): the runner asks /v1/models once the server is
ready and says in one console line what to set, before the first request to it; session.json records it;
every planned request is still sent — the images routes answer each with 400 "Model mismatch" (recorded with
the body's message), the chat route serves them, as the real 0.30.0 server does (measured,
/work/shared/data/vllm-omni-0.30-cpu/runner-report-model-mismatch.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_run import matrix, no_server_left, run

from runner.core.records import SCHEMA_VERSION

pytestmark = pytest.mark.slow

SERVE = ('["{python}", "-m", "runner.refserver", "--port", "{port}", "--preset", "tiny", "--vram-gib", '
         '"{vram_gib}", "--api", "0.30", "--served-model-name", "served-x"]')


def test_a_model_the_server_does_not_serve_is_said_once_before_the_requests_which_are_all_sent(
        tmp_path: Path) -> None:
    path = matrix(tmp_path, f"""
        [servers.omni-edits]
        command = {SERVE}
        dialect = "openai-images-edits"

        [servers.omni-chat]
        command = {SERVE}

        [cards.edits]
        server = "omni-edits"
        vram_mib = 64

        [cards.chat]
        server = "omni-chat"
        vram_mib = 64

        [flags.default]
        role = "default"

        [flags.other]
        role = "other"
        args = ["--cond-cache", "host"]

        [matrix]
        references = [1, 2]
        """)
    proc, run_dir = run(path)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    refuses = [i for i, x in enumerate(lines) if x.startswith('[servers.omni-edits] model = "served-x": ')]
    serves = [i for i, x in enumerate(lines) if x.startswith('[servers.omni-chat] model = "served-x": ')]
    # one line per server table, although each table serves two sessions (flag sets)
    assert len(refuses) == 1 and len(serves) == 1, proc.stderr[-3000:]
    assert lines[refuses[0]] == (
        '[servers.omni-edits] model = "served-x": the matrix\'s model \'omni-edits\' is not what the server serves '
        '\'served-x\'; vLLM-Omni 0.30 refuses each of these requests with 400 "Model mismatch" (all are sent and '
        "recorded with the server's answer)")
    assert lines[serves[0]].endswith("its chat route does not check the model, so the requests are served")
    # said before any step of that server's card came back
    assert refuses[0] < min(i for i, x in enumerate(lines) if x.startswith("edits/"))
    assert serves[0] < min(i for i, x in enumerate(lines) if x.startswith("chat/"))

    for card, sent, checks in (("edits", "omni-edits", True), ("chat", "omni-chat", False)):
        for flags in ("default", "other"):
            session = json.loads((run_dir / card / flags / "session.json").read_text())
            assert session["schema_version"] == SCHEMA_VERSION
            model = session["served_model"]
            assert model["sent"] == sent and model["served"] == ["served-x"] and model["matches"] is False
            assert model["route_checks"] is checks and model["note"].startswith(f"[servers.{sent}] model = ")

    # every planned request was sent: each edits step is the server's 400 with its message, each chat step served
    edits = [json.loads(p.read_text()) for p in sorted(run_dir.glob("edits/*/refs-*/*.json"))]
    assert len(edits) == 4
    for s in edits:
        assert s["status"] == "failed" and s["failure"]["kind"] == "http_error", s
        assert s["failure"]["http_status"] == 400 and s["request"]["sends"] == 1
        assert "Model mismatch: request specifies 'omni-edits' but server is running 'served-x'." in \
            s["failure"]["message"]
    chat = [json.loads(p.read_text()) for p in sorted(run_dir.glob("chat/*/refs-*/*.json"))]
    assert len(chat) == 4 and all(s["status"] == "ok" for s in chat)
    # the 0.30 chat part's stage durations, in milliseconds on the wire, are kept in seconds
    assert all(set(s["server_stage_durations_s"]) == {"queue_wait", "stage_0_gen"} for s in chat)
    assert all(0 < s["server_stage_durations_s"]["stage_0_gen"] < s["wall_s"] for s in chat)
    no_server_left(run_dir)


def test_a_served_model_says_nothing_and_a_server_without_the_list_is_a_note(tmp_path: Path) -> None:
    """The matrix names the served model: no line, `matches` true. A server whose /v1/models gives no list
    (the 2025-12 snapshot's plain-text 500): no line, a note in the record, and the run goes on."""
    path = matrix(tmp_path, """
        [servers.named]
        command = ["{python}", "-m", "runner.refserver", "--port", "{port}", "--preset", "tiny",
                   "--api", "0.30", "--served-model-name", "served-x"]
        dialect = "openai-images-edits"
        model = "served-x"

        [servers.snapshot]
        command = ["{python}", "-m", "runner.refserver", "--port", "{port}", "--preset", "tiny",
                   "--api", "2025-12"]

        [cards.named]
        server = "named"
        vram_mib = 64

        [cards.snapshot]
        server = "snapshot"
        vram_mib = 64

        [flags.default]
        role = "default"

        [matrix]
        references = [1]
        """)
    proc, run_dir = run(path)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    assert "[servers." not in proc.stderr and "/v1/models" not in proc.stderr, proc.stderr[-3000:]
    named = json.loads((run_dir / "named/default/session.json").read_text())["served_model"]
    assert named == {"sent": "served-x", "served": ["served-x"], "matches": True, "route_checks": True,
                     "note": None}
    snapshot = json.loads((run_dir / "snapshot/default/session.json").read_text())["served_model"]
    assert snapshot["matches"] is None and snapshot["served"] == []
    assert snapshot["note"] == "GET /v1/models gave no list of served models (HTTP 500): the model 'snapshot' is " \
                               "sent unchecked"
    assert all(json.loads(p.read_text())["status"] == "ok" for p in run_dir.glob("*/default/refs-*/*.json"))
    no_server_left(run_dir)
