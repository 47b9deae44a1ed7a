"""A PyTorch caching-allocator snapshot (`torch.cuda.memory._snapshot()`, `_dump_snapshot`) → what held the
device memory at the OOM (pure: bytes in, facts out).

A snapshot is a pickle a server wrote: untrusted input. `load` unpickles it with an unpickler that refuses
every global (a real snapshot holds only dicts, lists, tuples, str, int, float, bool and None; any class,
function or persistent id is refused before it is looked up, so nothing named in the pickle ever runs),
after a size bound on the file and on its gzip-decompressed bytes. The reader then walks a bounded number of
segments, blocks, trace events and frames, so a pickle of shared references cannot make the walk explode.

What was live at the OOM:
- the snapshot's own segments, when it was taken at the OOM itself (an OOM observer: the trace's last event
  is the `oom`) or when there is no trace to replay;
- else the trace replayed up to its `oom` event (vLLM-Omni's profiler dumps at /stop_profile, after the
  failed request freed its activations): the blocks alive before the trace began (alive in the snapshot with
  no trace event, or freed later in the trace without an alloc in it) plus the trace's allocations not freed
  before the OOM.

Resident before the request vs allocated by it: a block is resident when it was allocated before the
request began — before the trace began (vLLM-Omni's profiler clears the history at /start_profile, so the
weights carry no frames and no alloc event), or before `request_began_us` on the trace's clock when the
server recorded history across requests; else it was allocated by the request. A history recorded across
requests without a known start cannot tell the two apart: the split is then unknown (`split=None`), never
guessed. Without any frames (history not recorded) there are no sites: "no frames recorded".

A site is the innermost frame outside torch and the Python standard library, package-relative as the OOM
sites are (observe/traceback: `diffusers/models/activations.py:88 in forward`). Inactive bytes are the
segments' blocks not allocated (fragmentation: PyTorch's "reserved by PyTorch but unallocated").

Untrusted input. What the pickle builds is bounded by the child it is read in (runner.observe.isolated: an
address-space cap and a deadline; the real 34-layer snapshot is 140 MB as a pickle, 18.7 M opcodes, ~0.8 GB
unpickled). The walk here takes a field only when it has the type a snapshot gives it — a text only when it is
a `str` of bounded length (never `str()` of an object: a repr of shared lists is ~160 GB, of deep nesting a
RecursionError), a figure only when it is an `int`; a frame whose filename or name is not a text is no frame.
Sizes, addresses and line numbers of 1 PiB or more (observe/reading.py's bound for every memory figure) refuse
the snapshot in one line. Each distinct frame list is read once (blocks that share one are not walked again) and
at most MAX_FRAMES_WALKED frames in all. Every text that leaves (a site, a function, a part's name) is masked
with the server's resolved secrets and made inert (control characters, bidi and line breaks as visible escapes)
here, where it enters; report.md and the plots escape their own markup on the way out.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from runner.observe import quote
from runner.observe.reading import MAX_BYTES
from runner.observe.traceback import FRAMEWORKS, SERVER_PACKAGES, STDLIB, package_path

T = TypeVar("T")
# The file, and its bytes once gunzipped. The real 34-layer Qwen-Image snapshot: 1.9 MB gzipped, 140 MB as a
# pickle; torch's _dump_snapshot writes it uncompressed.
MAX_FILE_BYTES = 256 * 2**20
MAX_BLOCKS = 200_000
MAX_EVENTS = 1_000_000
MAX_FRAMES = 64  # per block or event, innermost first
MAX_FRAMES_WALKED = 4_000_000  # in all, each distinct frame list counted once (the real snapshots: 1.6 M)
MAX_TEXT = 4096  # characters of a frame's filename or name, or of a part's name (real ones: under 100)
MAX_SITES = 2000  # (site, function, phase, part) groups kept, largest first (the real snapshots: 45)
HISTORY_ENTRIES = 100_000  # vLLM-Omni's and the reference server's max_entries: a trace this long has wrapped
MAX_TIME_US = 2**63  # the trace's clock (microseconds since the epoch: ~1.8e15, above MAX_BYTES)
SITE_CHARS, NAME_CHARS = 500, 200  # of a site and of a function or part name, as kept
NO_FRAMES = "no frames recorded"
NO_SITE = "no frame outside torch"
GZIP_MAGIC = b"\x1f\x8b"

Frame = tuple[str, int, str]  # (filename, line, function name)


class SnapshotError(ValueError):
    """A snapshot that cannot be read: one line saying why (refused, too large, broken, not a snapshot)."""


class _NoGlobals(pickle.Unpickler):
    """Refuses every global and persistent id before looking anything up: nothing named ever runs."""

    def find_class(self, module: str, name: str) -> Any:
        raise SnapshotError(f"refused: the pickle names a global ({module[:60]}.{name[:60]}); an allocator "
                            f"snapshot holds only plain data")

    def persistent_load(self, pid: Any) -> Any:
        raise SnapshotError("refused: the pickle asks for a persistent object; an allocator snapshot holds only "
                            "plain data")


def gunzipped(data: bytes, max_bytes: int, error: type[ValueError]) -> bytes:
    """A server-written file's bytes, inflated at most to `max_bytes` when gzipped (a decompression bomb is an
    `error` naming the bound, never memory); bytes that are not gzip come back as they are."""
    if data[:2] != GZIP_MAGIC:
        return data
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as z:
            out = z.read(max_bytes + 1)
    except (OSError, EOFError) as exc:
        raise error(f"broken gzip: {exc}") from None
    if len(out) > max_bytes:
        raise error(f"too large: more than {max_bytes} bytes once decompressed")
    return out


def load(data: bytes, max_bytes: int = MAX_FILE_BYTES) -> dict[str, Any]:
    """An allocator snapshot's bytes (a pickle, gzipped or not) → its dict; SnapshotError naming why not."""
    if len(data) > max_bytes:
        raise SnapshotError(f"too large: {len(data)} bytes > {max_bytes}")
    data = gunzipped(data, max_bytes, SnapshotError)
    try:
        obj = _NoGlobals(io.BytesIO(data)).load()
    except SnapshotError:
        raise
    except MemoryError:
        raise
    except Exception as exc:  # any malformed pickle: a truncated stream, a bad opcode, a stack error
        raise SnapshotError(f"not a pickle: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("segments"), list):
        raise SnapshotError("not an allocator snapshot: no 'segments' list")
    return obj


@dataclass(frozen=True)
class Site:
    site: str  # package-relative path:line, or NO_FRAMES / NO_SITE
    function: str | None
    phase: str  # "resident" | "request" | "unknown"
    bytes: int
    blocks: int
    part: str | None = None  # the server's name for these blocks (their `user_metadata`), if it gave one


@dataclass(frozen=True)
class Named:
    """A part the server named itself (PyTorch's per-allocation `user_metadata`, e.g. the conditioning cache)."""

    name: str
    phase: str
    bytes: int
    blocks: int


@dataclass(frozen=True)
class Held:
    at: str  # "oom" or "snapshot" (the snapshot's moment: a peak, when there was no OOM)
    exact: str  # how the live blocks were found: "segments at the oom", "trace replayed to the oom", "segments"
    active_bytes: int
    resident_bytes: int | None  # None: the split is unknown
    request_bytes: int | None
    inactive_bytes: int | None  # None: a replay cannot know the segments at the OOM
    reserved_bytes: int
    segments: int
    blocks: int
    tried_bytes: int | None  # the oom event's size
    frames: bool  # any frames recorded
    by_site: tuple[Site, ...]
    named: tuple[Named, ...] = ()
    expandable_segments: bool | None = None
    notes: tuple[str, ...] = field(default=())
    history_full: bool = False  # the trace wrapped: a live block without its alloc may be the request's


@dataclass(frozen=True)
class _Block:
    size: int
    frames: tuple[Frame, ...]
    resident: bool | None
    metadata: str = ""


def _figure(v: Any, what: str, bound: int = MAX_BYTES) -> int:
    """An int field of the snapshot (0 when absent, not an int, or negative); SnapshotError at the bound."""
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        return 0
    if v >= bound:  # never formatted: a 5000-digit int cannot even become text
        beyond = "any clock" if bound == MAX_TIME_US else "any memory (1 PiB or more)"
        raise SnapshotError(f"refused: a {what} beyond {beyond}; not a snapshot PyTorch wrote")
    return v


class _Walk:
    """One snapshot's walk: texts taken only as `str` and masked, figures bounded, frame lists read once each
    (by identity: the pickle's shared lists are one list here) and at most MAX_FRAMES_WALKED frames in all."""

    def __init__(self, secrets: Iterable[str], own: tuple[str, ...]) -> None:
        self.secrets = tuple(sorted({s for s in secrets if len(s) >= quote.MIN_SECRET}, key=len, reverse=True))
        self.own = own
        self.walked = 0
        self.cut = False
        self._frames: dict[int, tuple[Frame, ...]] = {}
        self._sites: dict[int, tuple[str, str | None]] = {}
        self._masked: dict[str, str] = {}

    def text(self, v: Any) -> str | None:
        """A field that is a str of at most MAX_TEXT characters, its secrets masked; else None."""
        if not isinstance(v, str) or len(v) > MAX_TEXT:
            return None
        if not self.secrets:
            return v
        out = self._masked.get(v)
        if out is None:
            out = quote.mask(v, self.secrets)
            self._masked[v] = out
        return out

    def metadata(self, v: Any) -> str:
        return self.text(v) or ""

    def frames(self, raw: Any) -> tuple[Frame, ...]:
        if not isinstance(raw, list | tuple):
            return ()
        known = self._frames.get(id(raw))
        if known is not None:
            return known
        if self.walked >= MAX_FRAMES_WALKED:
            self.cut = True
            return ()
        out = []
        for f in raw[:MAX_FRAMES]:
            self.walked += 1
            if not isinstance(f, dict):
                continue
            path, name = self.text(f.get("filename")), self.text(f.get("name"))
            if path is not None and name is not None:  # a frame without both texts is no frame
                out.append((path, _figure(f.get("line"), "line number"), name))
        self._frames[id(raw)] = got = tuple(out)
        return got

    def site(self, frames: tuple[Frame, ...]) -> tuple[str, str | None]:
        known = self._sites.get(id(frames))
        if known is None:
            self._sites[id(frames)] = known = site_of(frames, self.own)
        return known


def _outside_torch(path: str) -> bool:
    if not path or path.startswith("<"):
        return False
    _, package = package_path(path)
    if package in FRAMEWORKS:
        return False
    return any(d in path for d in ("site-packages", "dist-packages")) or not STDLIB.search(path.replace("\\", "/"))


def site_of(frames: Sequence[Frame], own: tuple[str, ...] = SERVER_PACKAGES) -> tuple[str, str | None]:
    """(site, function): the innermost frame outside torch and the standard library (frames innermost first),
    package-relative as an OOM's site is (`own`: the server's and the model's packages, however installed)."""
    if not frames:
        return NO_FRAMES, None
    for path, line, name in frames:
        if _outside_torch(path):
            return f"{package_path(path, own)[0]}:{line}", name
    return NO_SITE, None


def _events(snap: Mapping[str, Any]) -> list[dict[str, Any]]:
    traces = snap.get("device_traces")
    if not isinstance(traces, list):
        return []
    # one device per server process here: the device with the most events (the OOM's)
    best = max((t for t in traces if isinstance(t, list)), key=len, default=[])
    return [e for e in best[:MAX_EVENTS] if isinstance(e, dict)]


def _segments(snap: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [s for s in snap["segments"] if isinstance(s, dict)]


def _seg_blocks(segments: Iterable[Mapping[str, Any]]) -> Iterable[tuple[int, Mapping[str, Any]]]:
    n = 0
    for seg in segments:
        addr = _figure(seg.get("address"), "segment address")
        blocks = seg.get("blocks")
        if not isinstance(blocks, list):
            continue
        for b in blocks:
            if n >= MAX_BLOCKS:
                return
            if isinstance(b, dict):
                n += 1
                yield _figure(b.get("address"), "block address") or addr, b
                addr += _figure(b.get("size"), "block size")


def _time(e: Mapping[str, Any]) -> int:
    return _figure(e.get("time_us"), "trace time", MAX_TIME_US)


def _live_from_segments(walk: _Walk, segments: list[dict[str, Any]], trace_allocs: Mapping[int, tuple[int, str]],
                        began_us: int | None, traced: bool, covers_start: bool, pre: bool | None,
                        before: frozenset[tuple[int, int]] | None = None) -> list[_Block]:
    out = []
    for addr, b in _seg_blocks(segments):
        if b.get("state") != "active_allocated":
            continue
        alloc = trace_allocs.get(addr)  # (time_us, user_metadata) of this address's last alloc in the trace
        if before is not None:  # live in the snapshot before the request, at the same address and size
            resident: bool | None = (addr, _figure(b.get("size"), "block size")) in before
        elif not traced:
            resident = None
        elif alloc is None:
            resident = pre  # allocated before the trace's first event
        elif began_us is not None:
            resident = alloc[0] < began_us
        else:  # the trace began with the request (history cleared at its start), unless it covers the process
            resident = None if covers_start else False
        out.append(_Block(_figure(b.get("size"), "block size"), walk.frames(b.get("frames")), resident,
                          alloc[1] if alloc else ""))
    return out


def _replay(walk: _Walk, events: list[dict[str, Any]], oom_at: int, segments: list[dict[str, Any]],
            began_us: int | None, covers_start: bool, pre: bool | None) -> list[_Block]:
    """The live blocks at events[oom_at] (the oom event): the trace's allocations not freed before it, plus
    the blocks alive before the trace began."""
    live: dict[int, _Block] = {}
    freed_before: set[int] = set()  # pre-trace blocks freed before the OOM
    for e in events[:oom_at]:
        addr, action = _figure(e.get("addr"), "trace address"), e.get("action")
        if action == "alloc":
            t = _time(e)
            resident = (t < began_us) if began_us is not None else (None if covers_start else False)
            live[addr] = _Block(_figure(e.get("size"), "trace size"), walk.frames(e.get("frames")), resident,
                                walk.metadata(e.get("user_metadata")))
        elif action == "free_completed" and live.pop(addr, None) is None:
            freed_before.add(addr)
    allocated_in_trace = {_figure(e.get("addr"), "trace address") for e in events if e.get("action") == "alloc"}
    kept: list[_Block] = []  # the blocks from before the trace's first event
    for e in events[oom_at + 1:]:  # pre-trace blocks alive at the OOM and freed after it: size only
        addr = _figure(e.get("addr"), "trace address")
        if e.get("action") == "free_completed" and addr not in allocated_in_trace and addr not in freed_before:
            kept.append(_Block(_figure(e.get("size"), "trace size"), (), pre))
            freed_before.add(addr)
    for addr, b in _seg_blocks(segments):  # pre-trace blocks still alive at the snapshot
        if b.get("state") == "active_allocated" and addr not in allocated_in_trace and addr not in freed_before:
            kept.append(_Block(_figure(b.get("size"), "block size"), walk.frames(b.get("frames")), pre))
    return [*kept, *live.values()]


def _peak(events: list[dict[str, Any]]) -> int | None:
    """The index of the event after which the trace's own allocations held the most, when that is not the
    trace's end (else the snapshot's segments are that moment already)."""
    live, best, at = 0, 0, None
    for i, e in enumerate(events):
        action = e.get("action")
        if action == "alloc":
            live += _figure(e.get("size"), "trace size")
        elif action == "free_completed":
            live -= _figure(e.get("size"), "trace size")
        if live > best:
            best, at = live, i
    return at if at is not None and at < len(events) - 1 and live < best else None


def _shown(text: str, secrets: tuple[str, ...], limit: int) -> str:
    """A snapshot's text as it may be kept and shown: masked, one inert line, bounded."""
    return quote.console(quote.server_text(text, secrets, limit))


def live(snap: Mapping[str, Any]) -> list[tuple[int, int]]:
    """The (address, size) of every block allocated at the snapshot: what a later snapshot is told apart from."""
    return [(addr, _figure(b.get("size"), "block size")) for addr, b in _seg_blocks(_segments(snap))
            if b.get("state") == "active_allocated"]


def read(snap: Mapping[str, Any], request_began_us: int | None = None,
         own: tuple[str, ...] = SERVER_PACKAGES, secrets: Iterable[str] = (), at_end: bool = False,
         before: Iterable[tuple[int, int]] | None = None) -> Held:
    """What held the memory at the snapshot's OOM (or at the trace's high point, when its trace holds no OOM;
    `at_end`: at the snapshot itself, what outlived the request). `secrets`: the values the runner resolved into
    the server's environment, masked in every text kept. `before` (with `at_end`): the live blocks of a snapshot
    taken just before the request (`live`); a block live in both is resident, any other the request's — exact
    however long the trace, which a history that wrapped is not."""
    walk = _Walk(secrets, own)
    segments = _segments(snap)
    events = _events(snap)
    oom_at = next((i for i in range(len(events) - 1, -1, -1) if events[i].get("action") == "oom"), None)
    notes: list[str] = []
    traced = bool(events)
    trace_allocs: dict[int, tuple[int, str]] = {}
    for e in events:
        if e.get("action") == "alloc":
            trace_allocs[_figure(e.get("addr"), "trace address")] = (_time(e), walk.metadata(e.get("user_metadata")))
    # A trace that began with the process (every live block has its alloc in it, the weights too) cannot tell
    # by itself where the request began: only a given start can. A history cleared at the request's start
    # (vLLM-Omni's /start_profile) leaves the blocks allocated before it without an alloc event.
    live_addrs = [a for a, b in _seg_blocks(segments) if b.get("state") == "active_allocated"]
    covers_start = (traced and request_began_us is None and bool(live_addrs)
                    and all(a in trace_allocs for a in live_addrs))
    # A trace of HISTORY_ENTRIES events has wrapped: its first events were overwritten, so a live block without
    # its alloc event was made before the trace's first event, which may be after the request began.
    told = frozenset(before) if at_end and before is not None and oom_at is None else None
    full = len(events) >= HISTORY_ENTRIES and told is None  # a snapshot before the request tells it all the same
    pre = None if full and (request_began_us is None or _time(events[0]) >= request_began_us) else True
    if pre is None:
        notes.append(f"the allocator's history is full ({len(events):,} events, the servers' max_entries): its "
                     "first events were overwritten, so a block allocated before them may be the request's or the "
                     "load's")
    tried = _figure(events[oom_at].get("size"), "trace size") if oom_at is not None else None
    reserved = sum(_figure(s.get("total_size"), "segment size") for s in segments)
    inactive: int | None = sum(_figure(b.get("size"), "block size") for _, b in _seg_blocks(segments)
                               if b.get("state") == "inactive")
    peak_at = _peak(events) if oom_at is None and not at_end else None
    if peak_at is not None:  # no OOM: the live blocks at the trace's high point, not what outlived the request
        exact = "trace replayed to the peak"
        marked = [*events[:peak_at + 1], {"action": "peak"}, *events[peak_at + 1:]]
        blocks = _replay(walk, marked, peak_at + 1, segments, request_began_us, covers_start, pre)
        inactive = None
    elif oom_at is None or oom_at == len(events) - 1:
        exact = ("segments at the oom" if oom_at is not None else
                 "segments" if told is None else "segments against a snapshot before the request")
        blocks = _live_from_segments(walk, segments, trace_allocs, request_began_us, traced, covers_start, pre,
                                     told)
    else:
        exact = "trace replayed to the oom"
        blocks = _replay(walk, events, oom_at, segments, request_began_us, covers_start, pre)
        inactive = None
        notes.append("the snapshot was taken after the OOM: the live blocks come from the trace replayed to the "
                     "oom event; the segments' inactive bytes at the OOM are not known")
    frames = any(b.frames for b in blocks)
    if walk.cut:
        notes.append(f"more than {MAX_FRAMES_WALKED:,} frames: the blocks past them are read without their frames")
    if blocks and not frames:
        notes.append(NO_FRAMES + " (the allocator's history was off): no sites")
    split_known = all(b.resident is not None for b in blocks)
    if not traced and told is None:
        notes.append("no allocator trace: resident and request bytes cannot be told apart")
    elif not split_known and told is None:
        notes.append("the history covers the whole process and the server did not mark the request's start: "
                     "resident and request bytes cannot be told apart")
    by: dict[tuple[str, str | None, str, str | None], list[int]] = {}
    named: dict[tuple[str, str], list[int]] = {}
    for b in blocks:
        phase = "unknown" if not split_known else ("resident" if b.resident else "request")
        site, function = walk.site(b.frames)
        acc = by.setdefault((site, function, phase, b.metadata or None), [0, 0])
        acc[0] += b.size
        acc[1] += 1
        if b.metadata:
            n = named.setdefault((b.metadata, phase), [0, 0])
            n[0] += b.size
            n[1] += 1
    active = sum(b.size for b in blocks)
    resident = sum(b.size for b in blocks if b.resident) if split_known else None
    if max(active, reserved, inactive or 0) >= MAX_BYTES:
        raise SnapshotError("refused: its blocks add up to more than any memory (1 PiB or more); not a snapshot "
                            "PyTorch wrote")
    if len(by) > MAX_SITES:
        notes.append(f"{len(by) - MAX_SITES:,} smaller sites left out of the list (their bytes are in the totals)")
    settings = snap.get("allocator_settings")
    expandable = settings.get("expandable_segments") if isinstance(settings, dict) else None
    s = walk.secrets
    sites = sorted(by.items(), key=lambda kv: (-kv[1][0], kv[0][0]))[:MAX_SITES]
    parts = sorted(named.items(), key=lambda kv: -kv[1][0])[:MAX_SITES]
    return Held(at="oom" if oom_at is not None else "snapshot", exact=exact, active_bytes=active,
                resident_bytes=resident, request_bytes=None if resident is None else active - resident,
                inactive_bytes=inactive, reserved_bytes=reserved, segments=len(segments), blocks=len(blocks),
                tried_bytes=tried, frames=frames,
                by_site=tuple(Site(_shown(site, s, SITE_CHARS), None if f is None else _shown(f, s, NAME_CHARS), p,
                                   v[0], v[1], None if m is None else _shown(m, s, NAME_CHARS))
                              for (site, f, p, m), v in sites),
                named=tuple(Named(_shown(n, s, NAME_CHARS), p, v[0], v[1]) for (n, p), v in parts),
                expandable_segments=expandable if isinstance(expandable, bool) else None, notes=tuple(notes),
                history_full=pre is None)


def read_bytes(data: bytes, request_began_us: int | None = None, own: tuple[str, ...] = SERVER_PACKAGES,
               secrets: Iterable[str] = (), at_end: bool = False,
               before: Iterable[tuple[int, int]] | None = None) -> Held:
    """load + read, for a snapshot file's bytes (SnapshotError: one line why not, whatever went wrong)."""
    return _walked(data, lambda snap: read(snap, request_began_us, own, secrets, at_end, before))


def _walked(data: bytes, walk: Callable[[dict[str, Any]], T]) -> T:
    """`walk` of the loaded snapshot; SnapshotError with one line whatever went wrong in it."""
    snap = load(data)
    try:
        return walk(snap)
    except (SnapshotError, MemoryError):
        raise
    except Exception as exc:  # plain data of a shape no snapshot has, however it failed: one line, never a traceback
        raise SnapshotError(f"not an allocator snapshot: {type(exc).__name__}") from None


def to_json(held: Held) -> dict[str, Any]:
    """A reading as plain JSON (what the isolated reader hands back)."""
    return dataclasses.asdict(held)


def from_json(doc: Mapping[str, Any]) -> Held:
    """to_json's inverse (the runner's own child wrote it)."""
    return Held(**{**doc, "by_site": tuple(Site(**s) for s in doc["by_site"]),
                   "named": tuple(Named(**n) for n in doc["named"]), "notes": tuple(doc["notes"])})


def read_json(data: bytes, request_began_us: int | None = None, own: Sequence[str] = SERVER_PACKAGES,
              secrets: Sequence[str] = (), at_end: bool = False,
              before: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
    """read_bytes for the isolated reader (runner.observe.isolated): bytes in, JSON out."""
    told = None if before is None else [(int(a), int(n)) for a, n in before]
    return to_json(read_bytes(data, request_began_us, tuple(own), tuple(secrets), at_end, told))


def live_json(data: bytes) -> list[list[int]]:
    """`live` of a snapshot file's bytes, for the isolated reader (SnapshotError: one line why not)."""
    return _walked(data, lambda snap: [[a, n] for a, n in live(snap)])
