"""`--cond-cache retain`: the conditioning cache kept across requests, as the seed's Diffusers server keeps it.

Each reference's K/V (every layer) is made once, from that reference alone, and kept on the device for the
server's life: keyed by the reference as the model reads it (a digest of its resized pixels) and by its place in
the request (its K/V carry the position: the same picture in another place is another entry). Nothing is
evicted and nothing spills to the host, so the device memory left after a request grows by one entry per
distinct reference (R = layers x K and V x the reference's tokens x width x element size) and not when the same
references come again; a request whose references are all kept skips making their K/V, so it runs faster.
The per-request part (the text's K/V) is made and freed per request as in `device`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor


def reference_key(slot: int, model_input: np.ndarray) -> str:
    """The entry of a reference in place `slot` (0-based) whose input to the model is `model_input`."""
    digest = hashlib.sha256(np.ascontiguousarray(model_input).tobytes())
    digest.update(f"{model_input.dtype}{model_input.shape}".encode())
    return f"{slot}:{digest.hexdigest()}"


@dataclass
class Retained:
    """One reference's K/V, layer by layer, and what it holds on the device."""

    kv: list[tuple[Tensor, Tensor]]
    nbytes: int
    handles: list[int] = field(default_factory=list)  # the ledger's, where the engine charges it by hand


class RetainedConditions:
    """The entries, never evicted; hits and misses counted for /metrics, once per reference of a request (a
    request with true CFG asks for each reference once per pass: the second pass's ask is no hit)."""

    def __init__(self) -> None:
        self.entries: dict[str, Retained] = {}
        self.hits = 0
        self.misses = 0
        self.asked: set[str] = set()  # the keys the current request has asked for

    def new_request(self) -> None:
        self.asked.clear()

    def get(self, key: str) -> Retained | None:
        entry = self.entries.get(key)
        if key not in self.asked:
            self.asked.add(key)
            if entry is None:
                self.misses += 1
            else:
                self.hits += 1
        return entry

    def put(self, key: str, entry: Retained) -> None:
        self.entries[key] = entry

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())
