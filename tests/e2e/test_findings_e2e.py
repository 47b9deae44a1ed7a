"""Findings end to end on the reference server: a not-built card whose verdict names its contribution site
inside the refserver's model code, a per-reference cost within 10 % of the refserver's own accounting, and a
shortfall that matches the OOM that happened; profiles.json beside verdict.json."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jsonschema
import pytest
from PIL import Image

from runner.observe.quote import code

ROOT = Path(__file__).resolve().parents[2]
REFS = [ROOT / "examples" / "refs" / f"ref-{i}.png" for i in range(1, 5)]
FINDINGS_SCHEMA = json.loads((ROOT / "runner" / "schema" / "findings.schema.json").read_text())
RESULT_SCHEMA = json.loads((ROOT / "runner" / "schema" / "result.schema.json").read_text())
PROMPT = "shapes on a table"

pytestmark = pytest.mark.slow


def _own_accounting(vram_mib: float) -> list[int]:
    """The refserver's own ledger: its peak for 1, 2 and 3 references, the same request, in-process."""
    from runner.refserver.cli import build_parser, config_from_args
    from runner.refserver.engine import Engine, GenerationRequest, configure_torch

    config = config_from_args(build_parser().parse_args(["--preset", "tiny"]))  # no budget: every count runs
    configure_torch(config)
    engine = Engine(config)
    refs = tuple(Image.open(p) for p in REFS)
    return [engine.generate(GenerationRequest(prompt=PROMPT, references=refs[:n], width=128, height=128, steps=2,
                                              seed=1, true_cfg_scale=4.0, negative_prompt=" ")).peak_bytes
            for n in (1, 2, 3)]


def test_not_built_card_names_its_site_cost_per_reference_and_shortfall(tmp_path: Path) -> None:
    vram_mib = 7.75  # tiny, device cache: serves 1 and 2 references, runs out of memory at 3
    text = textwrap.dedent(f"""
        [run]
        name = "findings"
        seeds = [1]
        repeats = 1
        steps = 2
        size = "128x128"
        true_cfg_scale = 4.0
        negative_prompt = " "
        request_timeout_s = 60
        ready_timeout_s = 90
        results_dir = "{tmp_path / 'results'}"

        [servers.ref]
        command = ["{{python}}", "-m", "runner.refserver", "--port", "{{port}}", "--preset", "tiny",
                   "--vram-gib", "{{vram_gib}}"]

        [fixtures.shapes]
        prompt = "{PROMPT}"
        references = {json.dumps([str(p) for p in REFS])}

        [cards.tight]
        server = "ref"
        vram_mib = {vram_mib}

        [cards.tiny]
        server = "ref"
        vram_mib = 5.0

        [servers.omni-shaped]
        command = ["{{python}}", "{Path(__file__).parent / 'fake_vllm_omni_oom.py'}"]

        [cards.omni]
        server = "omni-shaped"
        vram_gib = 24

        [flags.default]
        role = "default"

        [matrix]
        references = [1, 2, 3]

        [verdict]
        target_references = 3
        """)
    path = tmp_path / "matrix.toml"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "runner", str(path), "--no-progress"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    (run,) = sorted((tmp_path / "results").glob("findings-*"))
    verdicts = {v["card"]: v for v in json.loads((run / "verdict.json").read_text())["verdicts"]}
    tight = verdicts["tight"]
    assert tight["world"] == "not-built", proc.stdout + proc.stderr
    findings = tight["findings"]
    jsonschema.validate({**findings}, {**FINDINGS_SCHEMA, "oneOf": [{"$ref": "#/$defs/Findings"}]})

    # the contribution site: file:line in function, inside the refserver's model code
    (site,) = findings["contribution_sites"]
    assert site["site"].startswith("runner/refserver/model.py:") and site["function"] in ("cond_forward",
                                                                                         "latent_forward")
    assert site["flag_sets"] == ["default"] and site["references"] == [3]
    model_line = (ROOT / site["site"].split(":")[0]).read_text().splitlines()[int(site["site"].split(":")[1]) - 1]
    assert "mem.hold(" in model_line  # the line that asked the (accounted) allocator for memory
    report = (run / "report.md").read_text()
    assert f"{code(site['site'])} in {code(site['function'])} stopped default at 3 refs" in report
    assert "### Findings" in report

    # the per-reference cost against the refserver's own accounting of one more reference
    memory = findings["flag_sets"]["default"]["memory"]
    own = _own_accounting(vram_mib)
    own_per_ref = own[1] - own[0]
    assert memory["points"] == 2 and abs(memory["per_reference_bytes"] - own_per_ref) <= 0.10 * own_per_ref

    # the shortfall matches the OOM that happened: the line puts 3 refs over the capacity the OOM states,
    # 2 refs (served) under it, and 3 refs needs at least what the OOM had in use plus what it asked for
    oom = memory["oom"]
    assert oom["references"] == 3 and oom["capacity_bytes"] == memory["capacity_bytes"] == round(vram_mib * 2**20)
    assert memory["shortfall_bytes"] > 0 and memory["predicted_peak_bytes"] == (
        memory["fixed_bytes"] + 3 * memory["per_reference_bytes"])
    assert memory["fixed_bytes"] + 2 * memory["per_reference_bytes"] <= memory["capacity_bytes"]
    assert memory["predicted_peak_bytes"] >= oom["in_use_bytes"] + oom["tried_bytes"]
    assert abs(memory["predicted_peak_bytes"] - own[2]) <= 0.02 * own[2]  # and what the server itself needs at 3

    # the failure record carries the anatomy and the site
    step = json.loads((run / "tight/default/refs-3/shapes-seed-1.json").read_text())
    jsonschema.validate(step, RESULT_SCHEMA)
    assert step["failure"]["oom"]["site"] == site["site"]
    assert step["failure"]["oom"]["reserved_unallocated_bytes"] == 0  # the CPU ledger has no cache

    # a server that cannot load: the site is the load path
    tiny = verdicts["tiny"]["findings"]
    (load_site,) = tiny["contribution_sites"]
    assert load_site["site"].startswith("runner/refserver/engine.py:") and load_site["function"] == "_load"
    assert load_site["references"] == [None] and tiny["functional"]["works"] is None

    # the real vLLM-Omni 0.30.0 load OOM (its log replayed: the traceback under vLLM's record prefix, again plain
    # and under `[rank0]: `, then the orchestrator's wrapper): the site is where it was raised, under vllm_omni/
    omni = verdicts["omni"]["findings"]
    (omni_site,) = omni["contribution_sites"]
    assert omni_site["site"] == "vllm_omni/diffusion/models/qwen_image/qwen_image_transformer.py:445"
    assert omni_site["function"] == "rope_params" and omni_site["tried_bytes"] == [192 * 2**10]
    session = json.loads((run / "omni/default/session.json").read_text())
    assert session["starts"][-1]["failure"]["oom"]["capacity_bytes"] == round(5.5 * 2**20)

    profiles = json.loads((run / "profiles.json").read_text())
    jsonschema.validate(profiles, {**FINDINGS_SCHEMA, "oneOf": [{"$ref": "#/$defs/Profiles"}]})
    tight_profile = next(c for c in profiles["cards"] if c["card"] == "tight")
    by_n = {c["references"]: [e["flags"] for e in c["serve"]] for c in tight_profile["counts"]}
    assert by_n == {1: ["default"], 2: ["default"], 3: []}
