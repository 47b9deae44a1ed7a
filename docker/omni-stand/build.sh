#!/usr/bin/env bash
# The vLLM-Omni test stand (stand/README.md) as an image the Docker engine runs, made with the steps the stand's venv is
# made with (stand/venv.sh), with no registry: the offline base (docker/lib.sh) and a wheelhouse made on this host from
# the stand's pin list; nothing is fetched inside the engine. Cached by content, in two images:
#   runner-omni-stand-pins:KEY  the pinned packages in /opt/venv (KEY: stand/requirements.txt, torch, stand/venv.sh,
#                               the base image): minutes, once per pin list
#   runner-omni-stand:KEY       + our plugin and the runner package (KEY: the pins' key, what `stand/venv.sh ours`
#                               installs, this folder): seconds
# so a rerun with nothing changed costs the hashes and one `docker image inspect`.
#
#   docker/omni-stand/build.sh        build what is missing; the last line on stdout is the image's tag
#   docker/omni-stand/build.sh tag    print the tag this checkout's content makes; build nothing
#   FORCE=1 docker/omni-stand/build.sh   rebuild both images (the wheelhouse is reused)
#
# Env: RUNNER_STAND_HOME (where the wheelhouse is kept, beside the stand's venv: ~/.cache/runner/stand), PYTHON (the
#      host interpreter that makes the wheelhouse; CPython 3.11 like bookworm's), BASE_IMAGE, DOCKER_HOST.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
source docker/lib.sh
source scripts/torch-cpu.sh
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
home="${RUNNER_STAND_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/runner/stand}"
mkdir -p "$home"
ctx=""
hash12() { sha256sum | cut -c1-12; }

# The base's Debian packages the stand's compiled code needs beyond the minimal base, from the host's apt sources (the
# base is bookworm, as the host): vLLM's CPU kernels (vllm._C) link libnuma; without it vLLM warns and runs without them.
debs=(libnuma1)
# What the packages are: the pin list, torch and the debs (the wheelhouse's key); with the steps and the base, the pins
# image's.
wheels_key="$( (echo "torch $torch_version"; echo "${debs[*]}"; cat stand/requirements.txt) | hash12)"
wheels="$home/wheelhouse-$wheels_key"
pins_key() { (echo "$wheels_key"; cat stand/venv.sh; docker image inspect -f '{{.Id}}' "$BASE_IMAGE") | hash12; }
image_key() { (pins_key; stand/venv.sh ours-key; cat "$HERE/Dockerfile" "$HERE/build.sh" docker/lib.sh) | hash12; }

# Every wheel the image installs, from the configured index through pip's cache: the pinned ones (`pip wheel` takes
# a published wheel as it is and builds one where a pin has only a source archive) and the CPU torch wheel, as
# scripts/torch-cpu.sh finds it; and the debs. Kept per machine by its key; a partial one is made again.
make_wheelhouse() {
  [ -e "$wheels/.complete" ] && { log "wheelhouse $wheels reused"; return; }
  local t0=$SECONDS
  rm -rf "$wheels"; mkdir -p "$wheels"
  log "wheelhouse: torch $torch_version (CPU) and $(wc -l < stand/requirements.txt) pins into $wheels"
  download_cpu_torch "$wheels" "$PYTHON" 2> >(grep -v "^WARNING: Location '" >&2)
  mkdir -p "$wheels/debs"
  (cd "$wheels/debs" && apt-get download -q -o APT::Sandbox::User=root "${debs[@]}" >/dev/null)
  "$PYTHON" -m pip wheel -q --disable-pip-version-check --no-deps -w "$wheels" -r stand/requirements.txt \
    2> >(grep -v "^WARNING: Location '" >&2)
  touch "$wheels/.complete"
  log "wheelhouse made in $((SECONDS - t0)) s ($(du -sh "$wheels" | cut -f1))"
}

# The pinned packages, installed offline into /opt/venv of a container of the base with the wheelhouse mounted
# read-only, committed as an image: the wheels never become a layer, and no 3 GB venv is copied between stages (the
# reference server's two-stage Dockerfile would do both at this size).
build_pins() {
  local tag="runner-omni-stand-pins:$1" t0=$SECONDS name="runner-omni-stand-pins-build-$$"
  if docker image inspect "$tag" >/dev/null 2>&1 && [ -z "${FORCE:-}" ]; then
    log "$tag exists, reused"; return
  fi
  make_wheelhouse
  log "installing the pins into $tag (offline)"
  docker rm -f "$name" >/dev/null 2>&1 || true
  if ! docker run --name "$name" --network none -e PIP_NO_CACHE_DIR=1 \
      --mount "type=bind,source=$wheels,target=/wheels,readonly" \
      --mount "type=bind,source=$ROOT/stand,target=/src,readonly" "$BASE_IMAGE" bash -euo pipefail -c "
        dpkg -i /wheels/debs/*.deb > /dev/null
        mkdir -p /opt/stand && cp /src/venv.sh /src/requirements.txt /opt/stand/
        python3 -m venv /opt/venv
        /opt/venv/bin/pip install -q --disable-pip-version-check --no-compile --no-index --no-deps \
            /wheels/torch-$torch_version*.whl
        /opt/stand/venv.sh pins /opt/venv --no-index --find-links /wheels
        /opt/stand/venv.sh finish /opt/venv" >&2; then
    docker rm -f "$name" >/dev/null 2>&1 || true
    log "the pins did not install from $wheels (above)"; exit 1
  fi
  docker commit -c 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'CMD ["/bin/bash"]' -c "LABEL runner.stand-pins=$1" "$name" "$tag" >/dev/null
  docker rm "$name" >/dev/null
  log "$tag built in $((SECONDS - t0)) s"
}

# Our two wheels (the plugin, the runner package) on the pins image; untagged until the whole chain imports.
build_image() {
  local tag="$1" pins="$2" t0=$SECONDS id current
  ctx="$(mktemp -d /tmp/runner-omni-stand.XXXXXX)"
  trap 'rm -rf "$ctx"' EXIT
  cp "$HERE/Dockerfile" "$ctx/"
  "$PYTHON" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$ctx/ours" \
    ./stand/plugin . 2> >(grep -v "^WARNING: Location '" >&2)
  rm -rf build stand/plugin/build  # pip's in-tree build copies
  id="$(docker build -q --build-arg "PINS=runner-omni-stand-pins:$pins" --label "runner.source-hash=${tag#*:}" \
        --label "runner.stand-pins=$pins" --label "runner.stand-checkout=$ROOT" "$ctx")"
  # The smoke check: vLLM, vLLM-Omni with the fixes and our platform import, with only what is inside and no network.
  docker run --rm --network none --entrypoint /opt/stand/venv.sh "$id" check /opt/venv >&2
  docker tag "$id" "$tag"
  # This checkout's superseded stand images (each runner change makes one): another checkout's are left to it.
  current="$(docker image inspect -f '{{.Id}}' "$tag" | cut -d: -f2 | cut -c1-12)"
  docker image ls -q --filter "label=runner.stand-checkout=$ROOT" runner-omni-stand | sort -u | while read -r old; do
    [ "$old" = "$current" ] || docker rmi "$old" >/dev/null 2>&1 || true
  done
  log "$tag built in $((SECONDS - t0)) s"
}

case "${1:-all}" in
  tag)
    docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 || { log "no $BASE_IMAGE: run $0 first"; exit 1; }
    echo "runner-omni-stand:$(image_key)" ;;
  all)
    build_base
    pins="$(pins_key)"
    tag="runner-omni-stand:$(image_key)"
    exec 9>"$home/.image.lock" && flock 9  # two checkouts building at once share the pins image and the wheelhouse
    build_pins "$pins"
    if docker image inspect "$tag" >/dev/null 2>&1 && [ -z "${FORCE:-}" ]; then
      log "$tag is up to date, reused"
    else
      build_image "$tag" "$pins"
    fi
    echo "$tag" ;;
  *) echo "usage: $0 [all|tag]" >&2; exit 2 ;;
esac
