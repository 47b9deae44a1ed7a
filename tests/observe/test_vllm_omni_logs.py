"""What the runner reads from the real vLLM-Omni 0.30.0 server's own logs and answers (issue 44, part 5 and 6):
a failed start is quoted by the cause of its exception chain, not the wrapper; an OOM at load is found and sited
even where a library swallowed it; a request OOM is sited at the server's own frame below the accounting shim's
`__torch_dispatch__`; an HTTP error is quoted by its body's message, never by the access-log line, with the
served model's path kept. Every log is recorded data (tests/observe/fixtures/vllm-omni-0.30-cpu/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.backends.base import Attempt, ExitInfo, RunningServer, StartFailed
from runner.core.records import Failure, FailureClass, ServerStart, SessionRecord, Status, StepRecord
from runner.core.vocab import Role
from runner.judge.verdict import blocked, decide_all
from runner.judge.verdict_text import summary
from runner.observe import quote
from runner.observe.failures import START_LOG_BYTES, classify_request, classify_start, server_lines
from runner.observe.quote import server_text
from runner.observe.traceback import chains, site_of
from runner.plan.lanes import ServerPlan
from runner.plan.matrix import ServerProfile, VerdictRules

FIX = Path(__file__).parent / "fixtures" / "vllm-omni-0.30-cpu"
KIB, MIB = 2**10, 2**20
WRAPPER = "RuntimeError: Orchestrator initialization failed:"


def tail(name: str, size: int = START_LOG_BYTES) -> str:
    """The end of a recorded log as a backend hands it to the classifier: the last `size` bytes, quoted."""
    data = (FIX / name).read_bytes()
    return server_text(data[-size:], limit=size)


def start(name: str, size: int = START_LOG_BYTES) -> Failure:
    return classify_start(exit_code=1, oom_killed=False, timed_out=False, log_tail=tail(name, size))


@pytest.mark.parametrize("size", [START_LOG_BYTES, 16_384])  # 16 KiB: the window before issue 44
def test_a_failed_start_is_quoted_by_its_cause_with_the_wrapper_kept(size: int) -> None:
    f = start("startup-no-platform.log", size)
    assert f.kind == FailureClass.LOAD_EXIT
    assert f.message == ("server exited with code 1 before it was ready: NotImplementedError "
                         "(raised in set_device, vllm/platforms/interface.py:538)")
    # the evidence reads as Python printed it: the cause, the marker, the wrapper; then the log's last lines
    assert f.evidence[:3] == ("NotImplementedError",
                              "The above exception was the direct cause of the following exception:", WRAPPER)
    assert server_lines(f) == ("NotImplementedError", WRAPPER)
    session = SessionRecord(key="cpu/default", card="cpu", flags="default", role="default", backend="local",
                            starts=(ServerStart(attempt=0, started_at=0.0, ready_s=None, failure=f),))
    stop = blocked("default", "default", 2, [], session, VerdictRules(target_references=2))
    assert stop.server_says[0] == "NotImplementedError" and "set_device" in stop.why, stop


def test_the_chain_is_read_per_stream_through_vllms_logger_and_rank_prefixes() -> None:
    """Four printings of one failure: two loggers (`ERROR … [stage_runtime.py:308] `), the thread's excepthook
    with another logger's line inside it, and the main thread's chain; the last chain is cause → wrapper."""
    found = chains((FIX / "startup-no-platform.log").read_text())
    assert [[exc for _, exc in chain] for chain in found] == [["NotImplementedError"]] * 3 + [
        ["NotImplementedError", WRAPPER]]
    frames, _ = found[0][0]
    assert frames[-1][:3] == ("/home/user/venv/lib/python3.11/site-packages/vllm/platforms/interface.py", 538,
                              "set_device")
    assert site_of(frames)[:2] == ("vllm_omni/diffusion/worker/diffusion_worker.py:332", "init_device")


def test_an_oom_a_library_swallowed_at_load_is_still_an_oom_at_load_with_its_site() -> None:
    f = start("load-oom-swallowed.log")
    assert f.kind == FailureClass.OOM_AT_LOAD and f.oom is not None, f
    assert "Tried to allocate 216.00 KiB" in f.evidence[0]  # the WARNING line: the only OOM text there is
    assert (f.oom.tried_bytes, f.oom.capacity_bytes) == (216 * KIB, 4 * MIB)
    # no OOM traceback: the site comes from the chain the start ended with (its first link with a server frame)
    assert (f.oom.site, f.oom.function) == ("vllm_omni/diffusion/model_loader/hub_prefetch.py:464",
                                            "from_pretrained_with_prefetch")
    assert f.oom.no_site is None


def test_the_swallowed_oom_lies_beyond_the_old_16_kib_window() -> None:
    """Why START_LOG_BYTES: the OOM line is 61 KB before the end of the log (four printings of the chain)."""
    assert start("load-oom-swallowed.log", 16_384).kind == FailureClass.LOAD_EXIT
    size = len((FIX / "load-oom-swallowed.log").read_bytes())
    assert 16_384 < size < START_LOG_BYTES


def test_a_clean_oom_at_load_is_sited_at_the_servers_line_not_the_accounting_shim() -> None:
    f = start("load-oom.log")
    assert f.kind == FailureClass.OOM_AT_LOAD and f.oom is not None
    assert (f.oom.site, f.oom.function) == ("vllm_omni/diffusion/models/qwen_image/qwen_image_transformer.py:445",
                                            "rope_params")
    assert (f.oom.tried_bytes, f.oom.capacity_bytes) == (192 * KIB, round(5.5 * MIB))
    assert f.evidence[0].startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 192.00 KiB")
    # the frames below the site are kept as evidence: the shim's `_oom` is there, never the site
    assert f.oom.frames[0].path == "vllm_omni/diffusion/models/qwen_image/qwen_image_transformer.py"


def test_a_request_oom_is_sited_at_the_servers_line_under_vllms_logger_prefix() -> None:
    body = (FIX / "request-oom-body.json").read_text()
    f = classify_request(http_status=500, body=server_text(body[:4000]), log_window=tail("request-oom.log"),
                         timed_out=False, server_exit=None, parse_problem=None)
    assert f is not None and f.kind == FailureClass.OOM and f.oom is not None
    assert (f.oom.site, f.oom.function) == (
        "vllm_omni/diffusion/models/qwen_image/pipeline_qwen_image_edit_plus.py:511", "_encode_vae_image")
    assert (f.oom.tried_bytes, f.oom.capacity_bytes) == (32 * MIB, 295 * MIB)


# The model-mismatch run (runner-report-model-mismatch.md): the body the runner recorded, with the recorder's
# `<path>` put back as the absolute path the server names; the window's one line is uvicorn's access log.
SERVED = "/home/user/work/tiny-qwen-image-edit-plus"
MISMATCH = ('{"error":{"message":"Model mismatch: request specifies \'omni\' but server is running '
            f"'{SERVED}'.\",\"type\":\"Bad Request\",\"param\":null,\"code\":400}}}}")
ACCESS = '(DiffusionWorker pid=2633) INFO:     127.0.0.1:50624 - "POST /v1/images/edits HTTP/1.1" 400 Bad Request'


def test_an_http_error_is_quoted_by_its_bodys_message_never_the_access_log() -> None:
    f = classify_request(http_status=400, body=server_text(MISMATCH, ["hf_secret_value"]), log_window=ACCESS + "\n",
                         timed_out=False, server_exit=None, parse_problem=None)
    assert f is not None and f.kind == FailureClass.HTTP_ERROR
    said = f"Model mismatch: request specifies 'omni' but server is running '{SERVED}'."
    assert f.message == f"HTTP 400: {said}"
    assert server_lines(f) == (f"HTTP 400: {said}",)  # the server's words; the access-log line is not
    assert ACCESS in f.evidence  # kept as context


def test_the_verdict_and_findings_quote_the_bodys_message_and_keep_the_served_path() -> None:
    """The served model's path is what the user must read to fix the matrix: masked only if the runner resolved
    it itself (a `${VAR}` value), kept through the record, the verdict's words and report.md's escaping."""
    f = classify_request(http_status=400, body=server_text(MISMATCH, ["hf_secret_value"]), log_window=ACCESS + "\n",
                         timed_out=False, server_exit=None, parse_problem=None)
    assert f is not None
    steps = [StepRecord(key=f"cpu/{flags}/refs-{n}/f-seed-1", card="cpu", flags=flags, role=Role(flags), fixture="f",
                        references=n, seed=1, status=Status.FAILED, started_at=float(n), wall_s=0.01, failure=f)
             for flags in ("default", "offload") for n in (1, 2)]
    (v,) = decide_all(steps, [], VerdictRules(target_references=2), ["cpu"])
    said = f"HTTP 400: Model mismatch: request specifies 'omni' but server is running '{SERVED}'."
    assert v.world == "undecided" and "POST /v1/images/edits" not in summary(v) + v.reason, summary(v)
    assert summary(v).startswith(f"cannot tell — default http_error at 2 refs [cpu/default/refs-2/f-seed-1]: {said}")
    assert v.findings is not None and v.findings.functional.server_says == said
    assert SERVED in quote.markdown(v.reason) and SERVED in quote.markdown(summary(v))


def test_an_access_log_line_is_never_the_servers_words_even_without_a_body_message() -> None:
    f = classify_request(http_status=502, body="<html>bad gateway</html>", log_window=ACCESS + "\n",
                         timed_out=False, server_exit=None, parse_problem=None)
    assert f is not None and server_lines(f) == ()


@pytest.mark.parametrize(("body", "said"), [
    ('{"error": {"message": "1 validation error:\\n  {\'type\': \'missing\', \'loc\': \'body.prompt\'}", '
     '"type": "Bad Request", "param": "body.prompt", "code": 400}}',
     "1 validation error:\n  {'type': 'missing', 'loc': 'body.prompt'}"),  # client-edit.log
    ('{"detail": "Not Found"}', "Not Found"),
    ('{"detail": [{"loc": ["body", "size"], "msg": "Input should be a valid string"}]}',
     "body.size: Input should be a valid string"),
    ('{"error": {"message": "Model mismatch: cut', None),  # cut inside the string: the body itself
    ('{"error": {"message": "Model mismatch", "type": "Bad Req', "Model mismatch"),  # cut after it
])
def test_the_body_message_of_the_shapes_servers_answer_with(body: str, said: str | None) -> None:
    f = classify_request(http_status=400, body=body, log_window="", timed_out=False, server_exit=None,
                         parse_problem=None)
    assert f is not None
    assert f.message == (f"HTTP 400: {said}" if said else f"HTTP 400: {body[:300]}")


class ExitsAtLoad(RunningServer):
    """A server whose log is a recorded one and which has exited with code 1 when first asked."""

    def __init__(self, tmp: Path, log: str) -> None:
        plan = ServerPlan(backend="local", profile=ServerProfile(name="t", command=("x",), port=1), argv=("x",),
                          env={})
        super().__init__(plan, Attempt(name="t", log_path=tmp / "server.log"))
        (tmp / "server.log").write_bytes(b"INFO start\n" * 20_000 + (FIX / log).read_bytes())  # a long load log
        self.port = 1

    def start(self) -> None: ...

    def exited(self) -> ExitInfo | None:
        return ExitInfo(code=1, oom_killed=False)

    def stop(self) -> None: ...


def test_the_backend_hands_the_classifier_enough_of_the_log(tmp_path: Path) -> None:
    server = ExitsAtLoad(tmp_path, "load-oom-swallowed.log")
    with pytest.raises(StartFailed) as failed:
        server.wait_ready(5, poll_s=0.01)
    f = failed.value.failure
    assert f.kind == FailureClass.OOM_AT_LOAD and f.oom is not None
    assert f.oom.site == "vllm_omni/diffusion/model_loader/hub_prefetch.py:464"
