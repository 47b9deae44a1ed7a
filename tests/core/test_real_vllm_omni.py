"""The runner's readers against what the real vLLM-Omni 0.30.0 server sent and logged (tests/fixtures/vllm-omni-0.30,
recorded on a CPU; its README says what was changed: only the cut base64 payloads, now a tiny valid PNG). Pure:
each parser reads the real bytes, no server is started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.core import records
from runner.core.records import FailureClass, StepRecord
from runner.meters.server import PEAK_GAUGES, read_gauges, read_page
from runner.observe.failures import classify_request, references_dropped
from runner.observe.oom import read_oom
from runner.run import dialects

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-omni-0.30"
MIB = 2**20


def body(name: str) -> bytes:
    return (REAL / name).read_bytes()


def installed(log: str) -> str:
    """The recorder's placeholders as install paths: `<venv>` a virtual environment, the probe's platform plugin
    (`<work>/plugin-acct`, which raised the OOM where a GPU's allocator would) an installed package beside
    vllm_omni. A path that begins with `<` is read as Python's `<frozen …>`, never the server's code."""
    return (log.replace("<work>/plugin-acct/", "/venv/lib/python3.11/site-packages/")
            .replace("<venv>", "/venv").replace("<python>", "/usr"))


@pytest.mark.parametrize("dialect", ["openai-images", "openai-images-edits"])
@pytest.mark.parametrize("name", ["images_generations_64.json", "images_generations_default.json",
                                  "images_edits.json"])
def test_the_images_api_answer_is_read_its_null_peak_is_no_peak_and_its_ms_are_seconds(name: str, dialect: str
                                                                                         ) -> None:
    doc = json.loads(body(name))
    parsed = dialects.parse(dialect, body(name))
    assert parsed.problem is None and parsed.image is not None and parsed.image.startswith(b"\x89PNG")
    assert parsed.server_peak is None  # "peak_memory_mb": null in metrics: not measured, never 0 bytes
    assert parsed.peak_unread == "metrics.peak_memory_mb: the server reported null (not measured)"
    wire = doc["metrics"]["stage_durations"]  # {"queue_wait_ms": …, "stage_0_gen_ms": …}: milliseconds
    assert set(wire) == {"queue_wait_ms", "stage_0_gen_ms"}
    assert parsed.stage_durations == {"queue_wait": pytest.approx(wire["queue_wait_ms"] / 1000),
                                      "stage_0_gen": pytest.approx(wire["stage_0_gen_ms"] / 1000)}


def test_the_chat_answer_keeps_its_peak_in_the_image_part_and_a_null_metrics_at_the_top() -> None:
    raw = body("chat_accounted_peak.json")
    doc = json.loads(raw)
    assert doc["metrics"] is None  # 0.30.0: the per-request figures are in the content part, not here
    parsed = dialects.parse("vllm-omni-chat", raw)
    assert parsed.problem is None and parsed.image is not None and parsed.image.startswith(b"\x89PNG")
    assert parsed.server_peak == dialects.ServerPeak(287.3621768951416, "choices[0].message.content[0].peak_memory_mb",
                                                     "reserved")
    assert parsed.peak_unread is None
    assert parsed.stage_durations == {"queue_wait": pytest.approx(0.3788499998336192e-3),
                                      "stage_0_gen": pytest.approx(1.4681105613708496)}


@pytest.mark.parametrize("name", ["chat_peak_zero.json", "chat_wrong_model_200.json"])
def test_a_chat_part_peak_of_zero_is_not_measured(name: str) -> None:
    parsed = dialects.parse("vllm-omni-chat", body(name))
    assert parsed.image is not None and parsed.server_peak is None
    assert parsed.peak_unread == "choices[0].message.content[0].peak_memory_mb: the server reported 0.0 (not measured)"
    assert parsed.stage_durations is not None and 1 < parsed.stage_durations["stage_0_gen"] < 10  # 2.1 s, not 2131


def test_a_step_record_of_version_4_with_the_servers_ms_reads_in_seconds() -> None:
    """Schema 4 kept 0.30.0's `stage_0_gen_ms` as it came under a field of seconds: reading it migrates."""
    old = {"key": "c/f/refs-1/x-seed-1", "card": "c", "flags": "f", "role": "default", "fixture": "x",
           "references": 1, "seed": 1, "status": "skipped", "skip_reason": "r", "schema_version": 4,
           "server_stage_durations_s": {"queue_wait_ms": 0.25, "stage_0_gen_ms": 2131.12, "diffusion": 1.5}}
    step = records.load(StepRecord, old)
    assert step.server_stage_durations_s == {"queue_wait": 0.00025, "stage_0_gen": pytest.approx(2.13112),
                                             "diffusion": 1.5}
    assert step.schema_version == records.SCHEMA_VERSION


def test_the_served_model_is_read_from_v1_models() -> None:
    ids = dialects.served_ids(200, body("models.json"))
    assert ids == ("<work>/tiny-qwen-image-edit-plus",)
    said = dialects.served_model("omni", "omni", ids, route_checks=True)
    assert said.matches is False and said.served == ids
    assert said.note == ('[servers.omni] model = "<work>/tiny-qwen-image-edit-plus": the matrix\'s model \'omni\' is '
                         "not what the server serves '<work>/tiny-qwen-image-edit-plus'; vLLM-Omni 0.30 refuses each "
                         'of these requests with 400 "Model mismatch" (all are sent and recorded with the server\'s '
                         "answer)")
    assert dialects.served_model("omni", ids[0], ids, route_checks=True).note is None
    # a table name with a dot is a quoted TOML key: the line stays what to paste
    dotted = dialects.served_model("omni.v2", "omni.v2", ids, route_checks=False).note
    assert dotted is not None and dotted.startswith('[servers."omni.v2"] model = "<work>/tiny-qwen-image-edit-plus": ')


@pytest.mark.parametrize(("status", "raw", "why"), [
    (500, b"Internal Server Error", "HTTP 500"),  # the Dec-2025 snapshot in pure-diffusion mode
    (404, b'{"detail":"Not Found"}', "HTTP 404"),
    (200, b"<html>", "not JSON"),
    (200, b'{"object": "list"}', "no `data` list"),
    (200, b'{"object": "list", "data": [{"object": "model"}, 7]}', "no model id in `data`"),
])
def test_a_server_without_a_list_is_a_note_never_a_failure(status: int, raw: bytes, why: str) -> None:
    said = dialects.served_model("s", "m", dialects.served_ids(status, raw), route_checks=False)
    assert said.matches is None and said.served == ()
    assert said.note == f"GET /v1/models gave no list of served models ({why}): the model 'm' is sent unchecked"


def test_hostile_model_ids_are_bounded_masked_and_one_inert_line() -> None:
    ids = ("tok-SECRET-1234\n\x1b]8;;https://evil.example/\x1b\\x" + "y" * 5000, *[f"m{i}" for i in range(40)])
    raw = json.dumps({"object": "list", "data": [{"id": i, "object": "model"} for i in ids]}).encode()
    got = dialects.served_ids(200, raw)
    assert isinstance(got, tuple) and len(got) == dialects.MAX_MODELS
    said = dialects.served_model("s", "m", got, route_checks=True, secrets=("tok-SECRET-1234",))
    assert said.note is not None and "\n" not in said.note and "\x1b" not in said.note
    assert "SECRET" not in said.note and "SECRET" not in said.served[0] and "***" in said.served[0]
    assert len(said.served[0]) < 400


def test_the_oom_answer_and_its_log_window_give_the_oom_and_its_site() -> None:
    """The 500 says "Image generation failed: CUDA out of memory…" (type "BadRequestError"); the window logs the
    OOM where it was raised, under vLLM's record prefix, then the wrappers that carry its text on: the site is
    the allocation's, inside vLLM-Omni's pipeline (the real log's innermost vllm_omni frame)."""
    err = json.loads(body("chat_oom_500.json"))["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 500 and err["param"] is None
    window = installed((REAL / "oom-request-window.log").read_text())
    failure = classify_request(http_status=500, body=body("chat_oom_500.json").decode(), log_window=window,
                               timed_out=False, server_exit=None, parse_problem=None)
    assert failure is not None and failure.kind == FailureClass.OOM and failure.oom is not None
    oom = failure.oom
    assert oom.site == "vllm_omni/diffusion/models/qwen_image/pipeline_qwen_image_edit_plus.py:511"
    assert oom.function == "_encode_vae_image"
    assert (oom.tried_bytes, oom.capacity_bytes) == (32 * MIB, 295 * MIB)
    # the real "ref_images=2" line is the count the server received
    assert references_dropped(log_window=window, sent=2, http_status=200) is None
    dropped = references_dropped(log_window=window, sent=3, http_status=200)
    assert dropped is not None and "served 2 of 3" in dropped.message


def test_a_load_oom_is_read_from_the_traceback_raised_not_from_its_wrappers() -> None:
    """At load 0.30.0 logs the OOM four times (vLLM's logger, the thread's print, torch's `[rank0]: `) and ends
    with `RuntimeError: Orchestrator initialization failed: CUDA out of memory…`: the site is where it was
    raised (the real log's innermost vllm_omni frame), not the orchestrator's wait for it."""
    oom = read_oom(log=installed((REAL / "oom-at-load.log").read_text()))
    assert oom is not None
    assert oom.site == "vllm_omni/diffusion/models/qwen_image/qwen_image_transformer.py:445"
    assert oom.function == "rope_params"
    assert oom.capacity_bytes == round(5.5 * MIB) and oom.tried_bytes == 192 * 1024


def test_the_error_shapes_of_the_images_routes() -> None:
    for name, param in (("error_400_missing_prompt.json", "body.prompt"), ("error_400_model_mismatch.json", None)):
        err = json.loads(body(name))["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "Bad Request" and err["code"] == 400 and err["param"] == param
    failure = classify_request(http_status=400, body=body("error_400_model_mismatch.json").decode(), log_window="",
                               timed_out=False, server_exit=None, parse_problem=None)
    assert failure is not None and failure.kind == FailureClass.HTTP_ERROR and failure.http_status == 400
    assert "Model mismatch: request specifies 'omni'" in failure.message


def test_the_real_metrics_page_has_no_device_gauge_without_log_stats() -> None:
    """Without --log-stats (and with no measured peak) vllm_omni:peak_memory_mb is declared but never set: the
    page holds no device reading, and the family is known to be there; the same page with the sample the
    accounted probe recorded (`--log-stats`, a peak > 0) gives that request's peak."""
    text = (REAL / "metrics.txt").read_text()
    assert "# TYPE vllm_omni:peak_memory_mb gauge" in text and "\nvllm_omni:peak_memory_mb{" not in text
    assert read_gauges(text) is None
    assert read_page(text) == ("last-peak", None)  # declared: a later request may set it (asked again)
    sample = 'vllm_omni:peak_memory_mb{model_name="<work>/tiny-qwen-image-edit-plus",stage="0"} 287.3309268951416\n'
    with_sample = text.replace("# TYPE vllm_omni:peak_memory_mb gauge\n",
                               "# TYPE vllm_omni:peak_memory_mb gauge\n" + sample)
    assert read_gauges(with_sample) == ("last-peak", round(287.3309268951416 * MIB))
    assert PEAK_GAUGES == ("vllm_omni:peak_memory_mb",)
