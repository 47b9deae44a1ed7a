#!/usr/bin/env bash
# Build the reference-server image with no registry: an offline-made Debian base (debootstrap + docker
# import) and a wheelhouse made on this host. Each stage is skipped when its result already exists, so a
# second run costs a hash and one `docker image inspect`.
#
#   docker/refserver/build.sh            # build what is missing
#   FORCE=1 docker/refserver/build.sh    # rebuild the refserver image (the base is still reused)
#   FORCE=1 NO_CACHE=1 docker/refserver/build.sh   # ... without the engine's layer cache
#   KEEP_STAGE=1 STAGE_IMAGE=runner-refserver-venv:dev docker/refserver/build.sh   # keep the venv stage, tagged
#
# Env: BASE_IMAGE (runner-base:bookworm), IMAGE (runner-refserver:dev), MIRROR (from apt sources),
#      PYTHON (the host interpreter that makes the wheelhouse; must be CPython 3.11 like bookworm's),
#      DOCKER_HOST (the engine to build on).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
IMAGE="${IMAGE:-runner-refserver:dev}"
STAGE_IMAGE="${STAGE_IMAGE:-runner-refserver-venv:build-$$}"  # the venv stage, only while this build runs
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
WHEELS="$HERE/wheelhouse"
# The base image, the legacy builder, log and promote.
source "$HERE/../lib.sh"

# Content hash of what the image runs (the refserver package, packaging, this recipe): a rebuild happens
# only when one of these changed. Other runner modules ride along in the wheel but never run in the image.
source_hash() {
  (cd "$ROOT" && find runner/refserver runner/__init__.py -name '*.py' | LC_ALL=C sort | xargs sha256sum
   sha256sum pyproject.toml "$HERE/Dockerfile" "$HERE/build.sh") | sha256sum | cut -c1-16
}

# Third-party wheels: the refserver extra plus those core dependencies that runner.refserver imports (found
# from its import statements); the project's other dependencies (ansible, matplotlib, ...) stay out.
make_wheelhouse() {
  mkdir -p "$WHEELS/deps" "$WHEELS/project"
  "$PYTHON" - "$ROOT" >"$WHEELS/deps/requirements.txt" <<'PY'
import ast, importlib.metadata as md, pathlib, re, sys, tomllib
root = pathlib.Path(sys.argv[1])
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
name = lambda req: re.split(r"[<>=!~ ;\[]", req)[0].lower().replace("_", "-")
core = {name(d): d.split("#")[0].strip() for d in project["dependencies"]}
modules = set()
for f in (root / "runner" / "refserver").rglob("*.py"):
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            modules |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module.split(".")[0])
dists = {name(d) for m in modules for d in md.packages_distributions().get(m, [])}
reqs = [d.split("#")[0].strip() for d in project["optional-dependencies"]["refserver"]]
reqs += sorted(core[d] for d in dists if d in core)
# The CPU build on local disk; never let the resolver reach for a CUDA build.
reqs = ["torch==2.13.0" if name(r) == "torch" else r for r in reqs]
print("\n".join(reqs))
PY
  log "wheelhouse: $(tr '\n' ' ' <"$WHEELS/deps/requirements.txt")"
  "$PYTHON" -m pip download --quiet --only-binary=:all: -d "$WHEELS/deps" -r "$WHEELS/deps/requirements.txt" \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
  rm -f "$WHEELS"/project/*.whl
  "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation -w "$WHEELS/project" "$ROOT"
  rm -rf "$ROOT/build"
}

build_image() {
  local hash current t0
  hash="$(source_hash)"
  current="$(image_label "$IMAGE" runner.source-hash)"
  if [ "$current" = "$hash" ] && [ -z "${FORCE:-}" ]; then
    log "$IMAGE is up to date (source $hash), reused"; return
  fi
  t0=$(date +%s)
  make_wheelhouse
  # The venv stage first, under a tag of its own: the legacy builder keeps every stage as an image, and an
  # untagged 1.4 GB one would be left behind. The final build reuses it from the layer cache; it is removed
  # below (KEEP_STAGE=1 keeps it: a later source change then skips the dependency install).
  docker build -q ${NO_CACHE:+--no-cache} --build-arg "BASE=$BASE_IMAGE" --target venv -t "$STAGE_IMAGE" "$HERE" \
    >/dev/null
  # Build untagged, smoke-check, then tag: a broken build never becomes "up to date".
  local id
  id="$(docker build -q --build-arg "BASE=$BASE_IMAGE" --label "runner.source-hash=$hash" "$HERE")"
  [ -n "${KEEP_STAGE:-}" ] || docker rmi "$STAGE_IMAGE" >/dev/null || log "could not remove $STAGE_IMAGE"
  # Smoke check: the entry point starts with only what is inside the image, and no network.
  docker run --rm --network none "$id" python -c 'import importlib, pkgutil, runner.refserver as p
for m in pkgutil.iter_modules(p.__path__, "runner.refserver."):
    m.name.endswith("__main__") or importlib.import_module(m.name)' 
  promote "$id" "$IMAGE"
  log "$IMAGE built in $(( $(date +%s) - t0 )) s (source $hash)"
}

case "${1:-all}" in
  base) build_base ;;
  all) build_base; build_image ;;
  *) echo "usage: $0 [base|all]" >&2; exit 2 ;;
esac
