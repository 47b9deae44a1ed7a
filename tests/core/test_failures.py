"""The server's own last error lines, found in a log excerpt, carried in a failure's message and evidence."""

from __future__ import annotations

from runner.core.records import FailureClass
from runner.observe.failures import classify_request, classify_start, error_lines, server_lines

TRACEBACK = """\
INFO starting
Traceback (most recent call last):
  File "<string>", line 1, in <module>
    import opentelemetry
ModuleNotFoundError: No module named 'opentelemetry'
"""


def test_error_lines_prefer_the_oom_and_the_traceback_over_error_level_lines() -> None:
    assert error_lines(TRACEBACK) == ("ModuleNotFoundError: No module named 'opentelemetry'",)
    oom = ("ERROR 11-30 12:00:01 [worker.py:88] generation failed\n"
           "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    assert error_lines(oom) == ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",)
    logged = "2026 INFO refserver: request 2 start\n2026 ERROR refserver: fault exit@2: exiting with code 1\n"
    assert error_lines(logged) == ("2026 ERROR refserver: fault exit@2: exiting with code 1",)
    assert error_lines("INFO all good\nINFO still good\n") == ()
    assert error_lines("  ValueError: indented, inside a traceback's source excerpt\n") == ()


def test_start_and_request_failures_carry_the_servers_line() -> None:
    f = classify_start(exit_code=1, oom_killed=False, timed_out=False, log_tail=TRACEBACK)
    assert f.kind == FailureClass.LOAD_EXIT
    assert f.message.endswith(": ModuleNotFoundError: No module named 'opentelemetry'")
    assert f.evidence[0] == "ModuleNotFoundError: No module named 'opentelemetry'"
    assert f.evidence.count(f.evidence[0]) == 1  # first, and not repeated in the tail after it
    quiet = classify_start(exit_code=None, oom_killed=False, timed_out=True, log_tail="INFO loading\n")
    assert quiet.kind == FailureClass.READY_TIMEOUT and quiet.message == "not ready before the deadline"
    crash = classify_request(http_status=None, body="", log_window="INFO x\nERROR refserver: fault exit@2\n",
                             timed_out=False, server_exit=1, parse_problem=None)
    assert crash.kind == FailureClass.CRASH and crash.message.endswith(": ERROR refserver: fault exit@2")


def test_a_leading_log_timestamp_is_left_out_of_the_message() -> None:
    log = "2026-11-30 02:52:29,185 ERROR refserver: fault exit@3: exiting\n"
    crash = classify_request(http_status=None, body="", log_window=log, timed_out=False, server_exit=1,
                             parse_problem=None)
    assert crash.message == "server exited with code 1 during the request: ERROR refserver: fault exit@3: exiting"
    assert crash.evidence[0] == log.strip()  # the evidence keeps the line whole


def test_an_oom_in_a_json_error_body_is_quoted_by_its_message_not_the_json() -> None:
    # vLLM-Omni 0.30.0's 500 for a request past the accounted card (tests/stand: the real body's shape)
    body = ('{"error":{"message":"Image generation failed: CUDA out of memory. Tried to allocate 16.00 MiB. GPU 0 '
            'has a total capacity of 192.00 MiB of which 6.27 MiB is free.","type":"InternalServerError",'
            '"param":null,"code":500}}')
    oom = classify_request(http_status=500, body=body, log_window="", timed_out=False, server_exit=None,
                           parse_problem=None)
    assert oom is not None and oom.kind == FailureClass.OOM
    assert oom.evidence[0].startswith("Image generation failed: CUDA out of memory. Tried to allocate 16.00 MiB")
    assert server_lines(oom)[0] == oom.evidence[0] and "{" not in oom.evidence[0]
    # a body that is not JSON keeps its OOM lines as they are
    plain = classify_request(http_status=500, body="CUDA out of memory. Tried to allocate 2.00 GiB", log_window="",
                             timed_out=False, server_exit=None, parse_problem=None)
    assert plain is not None and plain.evidence == ("CUDA out of memory. Tried to allocate 2.00 GiB",)
