"""OOM anatomy and the traceback-site rule on real PyTorch messages and real tracebacks (tests/core/fixtures/oom)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.observe.oom import last_message, parse_message, read_oom
from runner.observe.traceback import is_own, oom_traceback, package_path, site_of

FIX = Path(__file__).parent / "fixtures" / "oom"
MIB, GIB = 2**20, 2**30


def mib(x: float) -> int:
    return round(x * MIB)


def gib(x: float) -> int:
    return round(x * GIB)


def test_torch_2_11_message_with_a_memory_fraction_and_the_expandable_segments_hint() -> None:
    peaks = json.loads((FIX / "qwen-peaks.json").read_text())["runs"]
    default = parse_message(peaks["cap_default_allocator"]["oom_message"])
    assert default == {"tried_bytes": mib(480), "capacity_bytes": gib(139.80), "free_bytes": gib(134.92),
                       "in_use_bytes": gib(4.87), "allowed_bytes": gib(4.49), "allocated_bytes": gib(3.96),
                       "reserved_unallocated_bytes": mib(246.14)}
    expandable = parse_message(peaks["cap_expandable_segments"]["oom_message"])
    assert expandable["tried_bytes"] == mib(576) and expandable["reserved_unallocated_bytes"] == mib(85.14)


# Real messages of other torch versions (as users posted them; numbers kept).
TORCH_2_1 = ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 224.00 MiB. GPU 0 has a total "
             "capacty of 14.75 GiB of which 11.06 MiB is free. Process 3258 has 14.73 GiB memory in use. Of the "
             "allocated memory 14.04 GiB is allocated by PyTorch, and 509.85 MiB is reserved by PyTorch but "
             "unallocated. If reserved but unallocated memory is large try setting max_split_size_mb to avoid "
             "fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF")
TORCH_2_1_NON_PYTORCH = (
    "CUDA out of memory. Tried to allocate 102.00 MiB. GPU 0 has a total capacty of 39.38 GiB of which 29.81 MiB "
    "is free. Including non-PyTorch memory, this process has 39.32 GiB memory in use. Of the allocated memory "
    "37.54 GiB is allocated by PyTorch, and 1.12 GiB is reserved by PyTorch but unallocated.")
TORCH_1_X = ("RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; "
             "130.35 MiB already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch) If reserved "
             "memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.")
TORCH_2_2 = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 96.00 MiB. GPU 0 has a total capacity "
             "of 23.56 GiB of which 41.06 MiB is free. Including non-PyTorch memory, this process has 23.51 GiB "
             "memory in use. Of the allocated memory 23.12 GiB is allocated by PyTorch, and 11.45 MiB is reserved "
             "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
             "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def test_torch_2_1_other_processes_do_not_become_this_process() -> None:
    got = parse_message(TORCH_2_1)
    assert got["capacity_bytes"] == gib(14.75) and got["free_bytes"] == mib(11.06)
    assert got["in_use_bytes"] is None  # "Process 3258 has …": which process is this one is not said
    assert got["allocated_bytes"] == gib(14.04) and got["reserved_unallocated_bytes"] == mib(509.85)
    assert parse_message(TORCH_2_1_NON_PYTORCH)["in_use_bytes"] == gib(39.32)


def test_torch_1_x_reserved_in_total_gives_the_unallocated_part() -> None:
    got = parse_message(TORCH_1_X)
    assert got["tried_bytes"] == mib(36) and got["capacity_bytes"] == gib(7.93)
    assert got["allocated_bytes"] == mib(130.35) and got["free_bytes"] == mib(47.06)
    assert got["reserved_unallocated_bytes"] == mib(188) - mib(130.35)
    assert got["allowed_bytes"] is None and got["in_use_bytes"] is None


def test_torch_2_2_including_non_pytorch_memory() -> None:
    got = parse_message(TORCH_2_2)
    assert got["in_use_bytes"] == gib(23.51) and got["allocated_bytes"] == gib(23.12)
    assert got["reserved_unallocated_bytes"] == mib(11.45) and got["allowed_bytes"] is None


@pytest.mark.parametrize("body", [
    "Image generation failed: CUDA out of memory. Tried to allocate 2.00 GiB",  # vLLM-Omni 0.30, cut
    '{"error": {"message": "Image generation failed: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0", '
    '"type": "BadRequestError", "param": null, "code": 500}}',  # the type 0.30.0 gave it (measured)
])
def test_a_shortened_body_gives_what_it_has_and_leaves_the_rest_absent(body: str) -> None:
    oom = read_oom(body=body)
    assert oom is not None and oom.source == "response body" and oom.tried_bytes == 2 * GIB
    assert oom.capacity_bytes is None and oom.allocated_bytes is None and oom.reserved_unallocated_bytes is None
    assert oom.site is None and oom.no_site == "no traceback in the server log of the window"


def test_not_an_oom_and_an_unparseable_oom() -> None:
    assert read_oom(body="HTTP 500 internal error", log="ERROR something else") is None
    oom = read_oom(body="The server ran out of memory")  # an OOM, but no numbers: all absent, none zero
    assert oom is not None and all(getattr(oom, f) is None for f in
                                   ("tried_bytes", "capacity_bytes", "free_bytes", "allocated_bytes"))


def test_a_message_split_over_prefixed_log_lines() -> None:
    log = ("(EngineCore_0 pid=7) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.25 GiB. GPU 0 has "
           "a total capacty of 15.77 GiB of which 281.12 MiB is free. \n(EngineCore_0 pid=7) Including non-PyTorch "
           "memory, this process has 15.49 GiB memory in use. \n(EngineCore_0 pid=7) Of the allocated memory 15.04 "
           "GiB is allocated by PyTorch, and 4.72 MiB is reserved by PyTorch but unallocated. \n")
    msg = last_message(log)
    assert msg is not None and msg.startswith("torch.OutOfMemoryError: CUDA out of memory")
    got = parse_message(msg)
    assert got["in_use_bytes"] == gib(15.49) and got["reserved_unallocated_bytes"] == mib(4.72)


# --- the site rule -------------------------------------------------------------------------------------------

def test_real_diffusers_traceback_run_from_a_script_names_the_script() -> None:
    # The probe script is outside site-packages (the server's code by where it lives); diffusers is a third
    # party installed in site-packages, torch a framework: the site is the script's own innermost line.
    log = (FIX / "qwen-default.txt").read_text()
    oom = read_oom(log=log)
    assert oom is not None and oom.site == "/home/user/probe/qwen_oom.py:29" and oom.function == "run"
    assert oom.frames[0].code is not None and oom.frames[0].code.startswith("return m(hidden_states=x")
    assert [f.function for f in oom.frames] == ["run", "<module>"]
    assert oom.tried_bytes == mib(480) and oom.reserved_unallocated_bytes == mib(246.14)


def test_diffusers_as_the_server_wheel_and_clone() -> None:
    frames = oom_traceback((FIX / "qwen-default.txt").read_text())
    assert frames is not None
    site, function, kept, _ = site_of(frames[0], own=("diffusers",))  # diffusers named as the server's package
    assert (site, function) == ("diffusers/models/activations.py:85", "gelu")
    assert [f.where for f in kept[1:]] == ["diffusers/models/activations.py:89 in forward",
                                           "diffusers/models/attention.py:1741 in forward",
                                           "diffusers/models/transformers/transformer_qwenimage.py:730 in forward"]
    clone = (FIX / "qwen-default.txt").read_text().replace("/home/user/venv/lib/python3.12/site-packages/diffusers/",
                                                           "/home/user/src/diffusers/src/diffusers/")
    oom = read_oom(log=clone)  # an editable clone is outside site-packages: its frames are the server's code
    assert oom is not None and oom.function == "gelu"
    assert oom.site == "/home/user/src/diffusers/src/diffusers/models/activations.py:85"  # unknown package: whole
    named = read_oom(log=clone, own=("diffusers",))  # named: package-relative
    assert named is not None and named.site == "diffusers/models/activations.py:85"


@pytest.mark.parametrize("name", ["vllm-omni-wheel.log", "vllm-omni-clone.log"])
def test_vllm_omni_shaped_logs_with_worker_prefixes_and_interleaved_lines(name: str) -> None:
    oom = read_oom(log=(FIX / name).read_text())
    assert oom is not None
    assert oom.site == "vllm_omni/diffusion/models/qwen_image/pipeline_qwen_image_edit_plus.py:742"
    assert oom.function == "forward" and oom.frames[0].code == "noise_pred = self.transformer("
    assert oom.frames[1].where == "vllm_omni/diffusion/worker/gpu_worker.py:188 in execute_model"
    assert oom.tried_bytes == mib(480) and oom.allowed_bytes == gib(4.49)


def test_all_torch_frames_say_no_server_frame() -> None:
    log = "\n".join([
        "Traceback (most recent call last):",
        '  File "/usr/lib/python3.12/threading.py", line 1010, in run',
        "    self._target(*self._args, **self._kwargs)",
        '  File "/home/user/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py", line 125, in forward',
        "    return F.linear(input, self.weight, self.bias)",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB."])
    oom = read_oom(log=log)
    assert oom is not None and oom.site is None and oom.no_site == "no server frame"
    assert oom.frames[0].where == "torch/nn/modules/linear.py:125 in forward"


def test_paths_and_ownership() -> None:
    assert package_path("/home/runner/venv/lib/python3.12/site-packages/diffusers/x.py") == ("diffusers/x.py",
                                                                                             "diffusers")
    assert not is_own("/home/runner/venv/lib/python3.12/site-packages/diffusers/x.py")
    assert is_own("/home/user/venv/lib/python3.12/site-packages/vllm_omni/diffusion/models/utils.py")
    clone = package_path("/opt/vllm-omni/vllm_omni/diffusion/models/utils.py")
    assert clone == ("vllm_omni/diffusion/models/utils.py", "vllm_omni")
    assert not is_own("/usr/lib/python3.12/contextlib.py") and not is_own("<frozen runpy>")
    assert not is_own("/home/u/pytorch/torch/nn/functional.py")  # a torch clone is still the framework


# --- hostile figures and logs (issue 30) ---------------------------------------------------------------------

NINES = "9" * 400


def test_a_figure_no_device_can_have_is_absent_and_the_rest_stay() -> None:
    # F-1: a 400-digit figure is infinite as a float; it was an OverflowError that killed the run
    got = parse_message(f"CUDA out of memory. Tried to allocate {NINES} GiB. GPU 0 has a total capacity of "
                        "8.00 GiB of which 1.00 GiB is free.")
    assert got["tried_bytes"] is None and got["capacity_bytes"] == gib(8) and got["free_bytes"] == gib(1)
    oom = read_oom(body=f"CUDA out of memory. Tried to allocate {NINES} GiB", log=f"OutOfMemoryError: {NINES} B")
    assert oom is not None and oom.tried_bytes is None
    # F-5: the sign and the exponent belong to the figure; twenty digits and a 0-byte capacity are no device's
    got = parse_message("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 0 B of which "
                        "12345678901234567890 B is free. Including non-PyTorch memory, this process has -3.00 GiB "
                        "memory in use. 1e30 GiB allowed; Of the allocated memory 1.5e3 MiB is allocated by PyTorch, "
                        "and -2.00 GiB is reserved by PyTorch but unallocated.")
    assert got == {"tried_bytes": mib(2), "capacity_bytes": None, "free_bytes": None, "in_use_bytes": None,
                   "allowed_bytes": None, "allocated_bytes": mib(1500), "reserved_unallocated_bytes": None}
    assert parse_message("-2.00 GiB allowed; GPU 0 has a total capacity of 8 GiB")["allowed_bytes"] is None
    old = parse_message(f"Tried to allocate 1 MiB (GPU 0; 8 GiB total capacity; 1.00 GiB already allocated; "
                        f"{NINES} GiB reserved in total by PyTorch)")
    assert old["allocated_bytes"] == gib(1) and old["reserved_unallocated_bytes"] is None


TB_FRAMES = ['  File "/venv/lib/python3.12/site-packages/vllm_omni/diffusion/worker/gpu_worker.py", line 188, '
             'in execute_model', "    out = self.pipeline(req)",
             '  File "/venv/lib/python3.12/site-packages/vllm_omni/diffusion/models/edit.py", line 742, in forward',
             "    noise_pred = self.transformer(",
             '  File "/venv/lib/python3.12/site-packages/torch/nn/modules/module.py", line 1773, in _call_impl',
             "    return forward_call(*args, **kwargs)"]
TB_END = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 480.00 MiB."


@pytest.mark.parametrize("prefix", ["(VllmWorker rank=0 pid=4242) ", "\x1b[1;36m(DiffusionWorker pid=4243)\x1b[0;0m ",
                                    "\\x1b[1;36m(DiffusionWorker pid=4243)\\x1b[0;0m ",  # as the window reads it
                                    "(EngineCore_DP0 pid=7) "])
def test_real_worker_prefixes_keep_the_site(prefix: str) -> None:
    # F-2: vLLM's _add_prefix, with the rank and with its terminal colours
    lines = ["Traceback (most recent call last):", *TB_FRAMES, TB_END]
    log = "\n".join(prefix + line for line in lines) + "\n(APIServer pid=1) INFO interleaved\n"
    oom = read_oom(log=log)
    assert oom is not None and oom.site == "vllm_omni/diffusion/models/edit.py:742", oom.no_site
    assert oom.tried_bytes == mib(480)


def test_a_traceback_longer_than_the_log_window_keeps_its_frames_tail() -> None:
    # F-3: the window keeps the end (quote.bound): the header and the outer frames are left out
    from runner.observe.quote import server_text

    outer = ['  File "/venv/lib/python3.12/site-packages/vllm_omni/entry.py", line 1, in step', "    x()"] * 20_000
    log = server_text("\n".join(["Traceback (most recent call last):", *outer, *TB_FRAMES, TB_END]))
    assert "Traceback (most recent" not in log and len(log) <= 70_000
    oom = read_oom(log=log)
    assert oom is not None and oom.site == "vllm_omni/diffusion/models/edit.py:742" and oom.no_site is None
    assert [f.where for f in oom.frames][:2] == ["vllm_omni/diffusion/models/edit.py:742 in forward",
                                                 "vllm_omni/diffusion/worker/gpu_worker.py:188 in execute_model"]
