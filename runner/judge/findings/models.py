"""The findings' records, declared once (pydantic v2, frozen, unknown keys refused): they are written into
verdict.json (`findings`) and profiles.json, and their JSON Schema comes from these declarations. The OOM
report a failure carries (`Failure.oom`) is a step record's part, declared in runner.core.records."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from runner.core.records import Record

AlsoKind = Literal["per-reference", "until-next-request", "per-request"]  # a retention reading the levels also fit


class CountPeak(Record):
    references: int = Field(ge=0)
    bytes: int = Field(ge=0, description="the highest device peak over the count's served steps")
    steps: int = Field(ge=1, description="served steps at this count")


class OomFacts(Record):
    """The OOM that decided a flag set (at load, or the first in a request at or below the target)."""

    record: str = Field(description="the deciding record: a step key, or the session key for a load OOM")
    references: int | None = Field(default=None, description="the reference count; None at load")
    memory: Literal["device", "host"] = Field(default="device", description="which memory ran out (host: the "
                                                                            "kernel's OOM killer)")
    site: str | None = None
    function: str | None = None
    tried_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    in_use_bytes: int | None = None
    free_bytes: int | None = Field(default=None, description="free on the GPU at the failure (what other "
                                                             "processes held is not in this process's use)")
    capacity_bytes: int | None = Field(default=None, description="what bound: the per-process cap where the "
                                                                 "message names one, else the GPU's total")
    no_site: str | None = Field(default=None, description="why there is no site")


class HeldSite(Record):
    """Live bytes at the snapshot's moment grouped by where they were allocated."""

    site: str = Field(description="package-relative path:line of the innermost frame outside torch and the "
                                  "standard library; 'no frames recorded' when the history was off")
    function: str | None = None
    phase: Literal["resident", "request", "unknown"] = Field(description="resident: allocated before the "
                                                                         "request began; request: by it")
    bytes: int = Field(ge=0)
    blocks: int = Field(ge=0)
    part: str | None = Field(default=None, description="the server's own name for these blocks (their allocator "
                                                       "metadata), e.g. 'onloaded weights': not an activation")


class NamedPart(Record):
    """A part the server named itself (PyTorch's per-allocation metadata), e.g. the conditioning cache."""

    name: str
    phase: Literal["resident", "request", "unknown"]
    bytes: int = Field(ge=0)
    blocks: int = Field(ge=0)


class Counterfactual(Record):
    """What moving one part off the device (or removing it) would free at the OOM, against the shortfall."""

    move: str = Field(description="what would move: the resident set, a named part, the largest request-time "
                                  "allocation (its site), the fragmentation")
    frees_bytes: int = Field(ge=0)
    shortfall_bytes: int | None = Field(description="at least this much more was needed at the OOM: the failed "
                                                    "allocation minus what was free under the cap")
    enough: bool | None = Field(description="frees at least the shortfall (the failed allocation would have fit; "
                                            "the rest of the request may need more); None: no shortfall known")


class SiteGrowth(Record):
    """What one more reference adds at one allocation site, between two allocator snapshots of the same flag set
    at different reference counts (diagnosis = always)."""

    site: str
    function: str | None = None
    per_reference_bytes: int = Field(description="(bytes at the higher count - at the lower) / the counts' gap")
    from_references: int = Field(ge=0)
    to_references: int = Field(ge=1)


class HeldMemory(Record):
    """What held the device memory at the deciding OOM (or at the peak of the last served count), read from the
    allocator snapshot a diagnosis pass collected: resident before the request vs allocated by it, by site."""

    at: Literal["oom", "peak"]
    source: str = Field(description="'allocator snapshot'")
    file: str | None = Field(default=None, description="the snapshot, relative to the run folder (opens in "
                                                       "pytorch.org/memory_viz)")
    record: str | None = Field(default=None, description="the diagnosis record (diagnosis.json's session key)")
    references: int | None = Field(default=None, description="the reference count sent; None at load")
    how: str = Field(description="'segments at the oom' (taken by an OOM observer), 'trace replayed to the oom', "
                                 "or 'segments' (the snapshot's moment)")
    active_bytes: int = Field(ge=0)
    resident_bytes: int | None = Field(default=None, description="allocated before the request; None: unknown")
    request_bytes: int | None = None
    inactive_bytes: int | None = Field(default=None, description="in segments but unallocated (fragmentation)")
    reserved_bytes: int = Field(ge=0)
    tried_bytes: int | None = None
    oom_reserved_unallocated_bytes: int | None = Field(default=None, description="the OOM message's figure, "
                                                                                 "beside inactive_bytes")
    outside_pytorch_bytes: int | None = Field(default=None, ge=0, description="what the process held outside "
                                              "PyTorch's allocator at the OOM (the CUDA context, libraries' "
                                              "workspaces): the message's in-use figure minus PyTorch's reserved")
    by_site: tuple[HeldSite, ...] = Field(default=(), description="largest first (at most 12; the rest summed "
                                                                  "per phase as 'other sites')")
    named: tuple[NamedPart, ...] = ()
    counterfactuals: tuple[Counterfactual, ...] = ()
    growth: tuple[SiteGrowth, ...] = Field(default=(), description="which sites grow per reference, largest "
                                                                   "first, from the flag set's snapshots at two "
                                                                   "reference counts (diagnosis = always)")
    notes: tuple[str, ...] = ()


class NoHeld(Record):
    """Why a deciding OOM has no held-memory reading (one line, never invented sites)."""

    record: str | None = None
    why: str


class MemoryModel(Record):
    """One card × flag set: load peak, the peak per served reference count, a least-squares line through
    them (fixed working set + marginal bytes per reference), and the prediction at the target."""

    source: str | None = Field(description="the memory source of the peaks (one source for the whole line)")
    load_peak_bytes: int | None = None
    peaks: tuple[CountPeak, ...] = ()
    answered: tuple[int, ...] = Field(default=(), description="the reference counts at which a request came back "
                                                              "with an image, with a device figure or without")
    no_peak: str | None = Field(default=None, description="why requests that came back with an image have no "
                                                          "device-memory figure, from their records (what the "
                                                          "server reported, what each device source said); null "
                                                          "when each has one")
    fixed_bytes: int | None = Field(default=None, description="the line's value at 0 references")
    per_reference_bytes: int | None = Field(default=None, description="marginal bytes per reference (slope)")
    points: int = Field(default=0, ge=0, description="served reference counts the line goes through")
    worst_residual_bytes: int | None = None
    no_line: str | None = Field(default=None, description="why there is no line (fewer than two served counts, "
                                                          "or a line that does not describe the peaks: they "
                                                          "fall as references rise)")
    target_references: int
    predicted_peak_bytes: int | None = Field(default=None, description="at the target: measured where it was "
                                                                       "served, else the line's value")
    predicted_from: str | None = Field(default=None, description="'measured' or 'line'")
    capacity_bytes: int | None = None
    capacity_source: str | None = Field(default=None, description="'oom-allowed' (the OOM's per-process cap), "
                                                                  "'oom-total' (the OOM's GPU total), 'card' "
                                                                  "(the matrix's vram_gib)")
    shortfall_bytes: int | None = Field(default=None, description="predicted peak minus capacity; negative = "
                                                                  "headroom")
    oom: OomFacts | None = None
    held: HeldMemory | None = Field(default=None, description="what held the memory at the OOM (allocator "
                                                              "snapshot of the diagnosis pass)")
    no_held: NoHeld | None = Field(default=None, description="why there is no held-memory reading")


class Retention(Record):
    """What a request leaves behind (runner/judge/findings/retention.py): the levels after one server start's
    requests, in order, against the level after its load."""

    kind: Literal["freed", "per-reference", "until-next-request", "per-request", "cannot-tell"] = Field(
        description="freed: every level back at the load's, within the tolerance; per-reference: it grows by "
                    "`per_bytes` with each distinct reference sent (a cross-request cache); until-next-request: "
                    "`per_bytes` per reference of the last request, kept until the next one (the retention probe "
                    "fell back); per-request: with each request sent (a leak); cannot-tell: `why`")
    source: str = Field(description="the meter whose levels these are")
    bound: Literal["exact", "upper-bound"] = Field(description="exact: the server's own live-tensor figure; "
                                                               "upper-bound: a whole-device source")
    attempt: int = Field(ge=0, description="the server start read (the one that sent the most requests)")
    quiet_s: float = Field(ge=0, description="the quiet window each level was read in, seconds")
    load_bytes: int | None = Field(default=None, description="the level after the load, before any request")
    last_floor_bytes: int | None = Field(default=None, description="the level after the last request read")
    tolerance_bytes: int = Field(ge=0, description="a level within this of the load's is 'back at it': the larger "
                                                   "of 256 KiB and 1 % of the load level")
    points: int = Field(ge=0, description="requests with a level after them")
    per_bytes: int | None = Field(default=None, description="kept per distinct reference, or per request")
    residual_bytes: int | None = Field(default=None, description="the line's worst residual")
    fills_card_at: int | None = Field(default=None, description="distinct references (or requests) at which what "
                                                                "is kept alone would fill the card's capacity")
    also: dict[AlsoKind, int] = Field(
        default_factory=dict, description="readings the levels fit as well as `kind`, each with its bytes per "
                                          "reference or request (every request brought one new reference; every "
                                          "request carried all references before it): the retention probe tells "
                                          "them apart where it was sent and its level is clear; empty: none")
    probe_floor_bytes: int | None = Field(default=None, description="the level after the retention probe (the "
                                                                    "first request sent again after the last)")
    probe_references: int | None = Field(default=None, description="the probe's reference count")
    kept_references: int | None = Field(default=None, description="the request of the `kept` diagnosis pass "
                                                                  "(its reference count)")
    kept_bytes: int | None = Field(default=None, description="what that request allocated and still held live when "
                                                             "it ended, from its allocator snapshot (exact)")
    kept_sites: tuple[HeldSite, ...] = Field(default=(), description="those live blocks by site, largest first")
    kept_why: str | None = Field(default=None, description="why the `kept` pass has no such reading")
    why: str | None = None


MIN_PAIRS = 2  # one count's single cold send against its cached ones is one draw of the noise: it decides nothing


class CachedSpeed(Record):
    """A request whose references were all sent before against the one that first brought one, per count."""

    pairs: int = Field(ge=0, description="reference counts with a cold request and later ones")
    cold_s: float | None = Field(default=None, description="median of the cold requests' first sends")
    cached_s: float | None = Field(default=None, description="median over counts of the later sends' median")
    ratio: float | None = Field(default=None, description="median over counts of cold / cached")
    faster: bool = Field(default=False, description="cached faster in every pair by at least 15 %, over at least "
                                                    "MIN_PAIRS (2) pairs")
    slower: bool = Field(default=False, description="cached slower in every pair by at least 15 %, over at least "
                                                    "MIN_PAIRS (2) pairs")
    why: str | None = None


class FlagSetFindings(Record):
    role: str
    memory: MemoryModel
    retention: Retention | None = Field(default=None, description="what a request leaves behind (null: no "
                                                                  "request has a level after it)")
    speed: CachedSpeed | None = Field(default=None, description="cached against cold requests")


class Functional(Record):
    """Whether the reference path works at all, before memory is the question (the seed's scope item 1)."""

    works: bool | None = Field(description="True: a request with references came back with a usable image "
                                           "(sanity checks, minimum PSNR); False: requests with references "
                                           "failed for a reason that is not memory, or every image was broken; "
                                           "None: every failure was out of memory (memory is the question)")
    record: str | None = Field(default=None, description="the first served step with references, or the "
                                                         "failing record")
    flags: str | None = None
    references: int | None = None
    server_says: str | None = Field(default=None, description="the server's own line, when it failed")
    why: str | None = Field(default=None, description="what was wrong with the images that came back "
                                                      "(broken output, PSNR under the minimum)")


class ContributionSite(Record):
    """A distinct OOM site that stopped default or offload flag sets: where a fix would go."""

    site: str = Field(description="package-relative path:line")
    function: str | None = None
    flag_sets: tuple[str, ...]
    references: tuple[int | None, ...] = Field(description="the count each flag set ran out at (None: at load)")
    tried_bytes: tuple[int | None, ...] = Field(description="what each of those OOMs tried to allocate")


class Fragmentation(Record):
    """Two flag sets that differ only in allocator settings (PYTORCH_CUDA_ALLOC_CONF), their OOMs side by side."""

    a: str
    b: str
    a_reserved_unallocated_bytes: int
    b_reserved_unallocated_bytes: int
    b_allocated_bytes: int | None = None
    b_still_short: bool = Field(description="b ran out of memory too")


class Drift(Record):
    """A least-squares slope over a soak's requests, per request, with its 95 % interval: within each server start
    and reference count (so a mix of counts, and a restart, move no line), over the requests that were served."""

    per_request: float = Field(allow_inf_nan=False, description="bytes (or seconds) per request")
    low: float | None = Field(default=None, allow_inf_nan=False, description="the interval's low end (None: too "
                                                                              "few requests for one)")
    high: float | None = Field(default=None, allow_inf_nan=False)
    points: int = Field(ge=0, description="requests in the fit")
    distinguishable: bool = Field(description="the interval excludes 0")


class SoakFailure(Record):
    """The request that ended a soak."""

    number: int = Field(ge=1)
    references: int = Field(ge=0)
    kind: str = Field(description="the failure class, as the matrix's sends are classified")
    message: str
    memory: Literal["device", "host"] | None = Field(default=None, description="an OOM's memory")
    site: str | None = Field(default=None, description="an OOM's site: the innermost frame of the server's own code")
    function: str | None = None
    server_says: str | None = Field(default=None, description="the server's own last error line")
    floor_above_first_bytes: int | None = Field(
        default=None, description="the level the failing request started from (the level after the request "
                                  "before it) minus the level after the first request of the same server start")


class AboveCell(Record):
    """A reference count whose request, in service, peaked above the matrix cell's own peak (same source)."""

    references: int = Field(ge=0)
    number: int = Field(ge=1, description="the soak request with the highest such peak")
    peak_bytes: int = Field(ge=0, description="that request's peak")
    cell_peak_bytes: int = Field(ge=0, description="the matrix cell's highest peak at this count, same source")
    level_before_bytes: int | None = Field(default=None, description="the level after the request before it, same "
                                                                     "server start: what earlier requests left")


class SoakFindings(Record):
    """One soaked flag set in service (runner/judge/findings/soak.py), from its soak records."""

    chosen: str = Field(description="why it was soaked")
    planned: int = Field(ge=1, description="[soak] requests")
    minutes: float | None = None
    sent: int = Field(ge=0)
    served: int = Field(ge=0, description="requests that came back with an image")
    starts: int = Field(ge=0, description="server starts (a resume adds one)")
    stopped: str | None = Field(description="soak.json's `stopped`")
    outcome: Literal["held", "failed", "incomplete", "not run"] = Field(
        description="held: no failure up to `requests` or `minutes`; failed: its first failure ended it; "
                    "incomplete: interrupted (a resume continues it); not run: no request was sent (`why`)")
    failure: SoakFailure | None = None
    floor_source: str | None = Field(default=None, description="the device source of the levels")
    floor_bound: Literal["exact", "upper-bound"] | None = None
    first_floor_bytes: int | None = Field(default=None, description="the level after the first served request")
    last_floor_bytes: int | None = Field(default=None, description="the level after the last served request")
    floor_drift: Drift | None = Field(default=None, description="bytes per request the level after a request grows")
    peak_source: str | None = None
    highest_peak_bytes: int | None = None
    peak_drift: Drift | None = Field(default=None, description="bytes per request a request's peak grows")
    to_capacity: int | None = Field(default=None, ge=0, description="at the peak drift, requests after the last "
                                                                    "until a peak would reach the capacity")
    above_cells: tuple[AboveCell, ...] = Field(
        default=(), description="the reference counts whose in-service peak passed the matrix cell's by more than "
                                "ABOVE_TOLERANCE (runner/judge/findings/soak.py): a profile measured on a fresh "
                                "server is not what a server in service needs")
    latency_p50_s: float | None = None
    latency_p95_s: float | None = None
    latency_max_s: float | None = None
    latency_drift: Drift | None = Field(default=None, description="seconds per request")
    capacity_bytes: int | None = None
    why: str | None = Field(default=None, description="why it stopped, in one line (a start failure, the idle gate)")


class CardSoak(Record):
    """A card's soak: what it mixed and each soaked flag set's findings."""

    requests: int = Field(ge=1)
    minutes: float | None = None
    references: tuple[int, ...]
    order: Literal["cycle", "shuffle"]
    flag_sets: dict[str, SoakFindings] = Field(default={})
    not_soaked: str | None = Field(default=None, description="why no flag set was soaked (while none was)")


class Findings(Record):
    functional: Functional
    contribution_sites: tuple[ContributionSite, ...] = ()
    flag_sets: dict[str, FlagSetFindings] = Field(default={})
    fragmentation: tuple[Fragmentation, ...] = ()
    no_site_ooms: tuple[str, ...] = Field(default=(), description="deciding OOMs without a site (records)")
    soak: CardSoak | None = Field(default=None, description="the soak ([soak]): each soaked flag set in service")


# 2: each entry's `soak`
PROFILES_VERSION = 2


class ProfileEntry(Record):
    flags: str
    role: str
    peak_bytes: int | None
    peak_source: str | None
    headroom_bytes: int | None = Field(description="capacity minus peak (the flag set's binding capacity)")
    wall_s: float | None = Field(description="median over every timed send at this count")
    psnr_db: float | None = Field(description="mean PSNR against the baseline; None for the baseline cell")
    latency_ratio: float | None = Field(default=None, description="median over a default flag set's median "
                                                                  "at the same count, where one served it (medians: "
                                                                  "the verdict's own ratio may be of geometric means)")
    soak: str = Field(default="not soaked", description="its soak's outcome: 'held N requests', 'failed at request "
                                                        "k', 'incomplete: N of M requests', or 'not soaked'")


class CountProfile(Record):
    references: int
    serve: tuple[ProfileEntry, ...] = Field(description="flag sets serving this count within the quality and "
                                                        "latency rules, fastest first")
    excluded: dict[str, str] = Field(default={}, description="flag sets that served it but were too slow")


class CardProfile(Record):
    card: str
    capacity_bytes: int | None
    counts: tuple[CountProfile, ...]


class Profiles(Record):
    """profiles.json: per card and reference count, what a deployment or topology planner can use."""

    run_id: str
    schema_version: int = PROFILES_VERSION
    cards: tuple[CardProfile, ...]
