"""run.json: what was asked (the matrix, its hash, the plan) and what was found (versions, hosts, images,
GPUs), so a result can be reproduced and trusted later."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import platform
import socket
from importlib import metadata
from typing import Any

from runner import __version__
from runner.core.secrets import mask_text
from runner.plan import inputs
from runner.plan.lanes import Plan
from runner.plan.matrix import Card, FlagSet, Matrix, ServerProfile
from runner.run.store import RunStore


def iso_time(ts: float | None = None) -> str:
    return dt.datetime.fromtimestamp(ts if ts is not None else dt.datetime.now().timestamp(),
                                     dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def package_versions() -> dict[str, str]:
    out = {}
    for name in ("docker", "httpx", "numpy", "pillow", "scikit-image", "nvidia-ml-py", "torch", "fastapi"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[name] = metadata.version(name)
    return out


def all_env(matrix: Matrix) -> list[tuple[str, str]]:
    """Every env entry of the matrix (servers, cards, flag sets): what mask_text must look for."""
    holders: list[ServerProfile | Card | FlagSet] = [*matrix.servers.values(), *matrix.cards.values(),
                                                     *matrix.flags.values()]
    return [kv for h in holders for kv in h.env.items()]


def run_doc(matrix: Matrix, plan: Plan, run_id: str, started: float) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "started_at": started, "started_at_iso": iso_time(started),
        "matrix": {"path": str(matrix.path.resolve()), "sha256": matrix.sha256,
                   "text": mask_text(matrix.text, all_env(matrix))},
        "runner": {"version": __version__, "python": platform.python_version(),
                   "packages": package_versions()},
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(), "cpus": os.cpu_count()},
        "cards": {name: {"vram_gib": c.vram_gib, "backend": c.backend, **c.options.model_dump(),
                         "gpu": c.gpu, "server": c.server, "image": matrix.servers[c.server].image,
                         "meters": list(c.meters)} for name, c in matrix.cards.items()},
        "plan": {"lanes": len(plan.lanes), "steps": len(plan.steps), "sessions": [s.key for s in plan.sessions]},
        "inputs": inputs.fingerprint(matrix, plan, salt=run_id),
    }


def card_facts(cards: dict[str, Any], store: RunStore) -> dict[str, Any]:
    """What the run learned about each card's host: the served image's id and digests, the engine, and the
    GPU (name, UUID, driver) from the idle baseline — so run.json says what was measured, not only asked."""
    facts = {name: dict(doc) for name, doc in cards.items()}
    for session in store.load_sessions():
        card = facts.setdefault(session.card, {})
        start = next((s for s in session.starts if s.info), None)
        if start:
            for key in ("image_id", "repo_digests", "engine_version", "docker_host"):
                if start.info.get(key) is not None:
                    card.setdefault(key, start.info[key])
        gpu = (session.idle_baseline or {}).get("gpu")
        if gpu:
            card.setdefault("gpu_facts", gpu)
        for s in session.starts:
            if s.info.get("slurm_job_id") is not None:  # slurm: which job, node and GPU each start ran on
                card.setdefault("slurm", []).append(_slurm_fact(session.key, s.attempt, s.info))
    return facts


def _slurm_fact(key: str, attempt: int, info: dict[str, Any]) -> dict[str, Any]:
    gpu = info["gpu"] if isinstance(info.get("gpu"), dict) else {}
    return {"session": key, "attempt": attempt, "job_id": info["slurm_job_id"], "step_id": info.get("slurm_step_id"),
            "node": info.get("slurm_node"), "cuda_visible_devices": info.get("cuda_visible_devices"),
            "queue_wait_s": info.get("queue_wait_s"), "gpu_uuid": gpu.get("uuid"), "gpu_name": gpu.get("name")}
