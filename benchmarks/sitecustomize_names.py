"""Names the suite's Python processes for the kernel's process accounting (benchmarks/process_cpu.py), which knows a
process only by its 15-character command name: every Python program would be `python`. In a scratch clone only:

    cp benchmarks/sitecustomize_names.py .venv/lib/python3.11/site-packages/sitecustomize.py

rs-qwen / rs-toy: a reference server (the Qwen-Image arch or the toy one); rn-run, rn-report, rn-plan…: the runner
and its commands; pytest-gw: an xdist worker; s-<script>: a script the tests start (fake servers, Ansible's
modules). One test reads a process's real name in an error (tests/safety/test_local_safety.py, "(python"): it
fails under this naming.
"""

from __future__ import annotations

import ctypes
import os
import sys

PR_SET_NAME = 15
RUNNER_COMMANDS = ("report", "plan", "compare", "schema", "meter", "provision", "refserver")


def name(argv: list[str]) -> str | None:
    if "-m" in argv:
        i = argv.index("-m")
        module = argv[i + 1] if i + 1 < len(argv) else ""
        if module == "runner.refserver":
            return "rs-qwen" if "qwen-image" in argv else "rs-toy"
        if module == "runner":
            command = argv[i + 2] if i + 2 < len(argv) else ""
            return "rn-" + (command if command in RUNNER_COMMANDS else "run")
        return f"m-{module}"
    if len(argv) > 1 and argv[1] == "-u":  # execnet's bootstrap of an xdist worker
        return "pytest-gw"
    script = next((a for a in argv[1:3] if a.endswith(".py")), None)
    return f"s-{os.path.basename(script)}" if script else None


given = name(list(getattr(sys, "orig_argv", sys.argv)))
if given is not None:
    ctypes.CDLL(None).prctl(PR_SET_NAME, given.encode()[:15], 0, 0, 0)
