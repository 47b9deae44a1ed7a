# Sourced by the image builds that need no registry (docker/refserver/build.sh, docker/omni-stand/build.sh): the
# offline Debian base, and an image made current by content (built untagged, checked, then tagged; the one it
# supersedes removed). The legacy builder is used (DOCKER_BUILDKIT=0): it needs no buildx plugin and never looks
# for a registry.
export DOCKER_BUILDKIT=0
BASE_IMAGE="${BASE_IMAGE:-runner-base:bookworm}"

log() { printf '[%s %s] %s\n' "$(basename "$0")" "$(date +%T)" "$*" >&2; }

# The Debian mirror apt already uses (deb822 .sources first, then one-line lists).
mirror() {
  if [ -n "${MIRROR:-}" ]; then echo "$MIRROR"; return; fi
  local uri
  uri="$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | grep -v -- '-security' | head -1 | awk '{print $2}')"
  [ -n "$uri" ] || uri="$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
                          | grep -v -- '-security' | head -1 | awk '{print $2}')"
  echo "${uri:-http://deb.debian.org/debian}"
}

# runner-base:bookworm: debootstrap (minbase, python3) imported into the engine. Built once; reused while it exists.
build_base() {
  if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    log "base $BASE_IMAGE exists, reused"; return
  fi
  command -v debootstrap >/dev/null || { log "debootstrap missing: apt-get install -y debootstrap"; exit 1; }
  local dir t0
  dir="$(mktemp -d /tmp/runner-base.XXXXXX)"
  t0=$(date +%s)
  log "debootstrap bookworm from $(mirror) into $dir"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$dir" "$(mirror)" >"$dir.log" 2>&1 || { tail -20 "$dir.log" >&2; rm -rf "$dir"; exit 1; }
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
  tar -C "$dir" -c . | docker import -c 'CMD ["/bin/bash"]' -c 'ENV LANG=C.UTF-8' - "$BASE_IMAGE" >/dev/null
  rm -rf "$dir" "$dir.log"
  log "base $BASE_IMAGE built in $(( $(date +%s) - t0 )) s"
}

# The value of one label of an image; empty when the image or the label is missing.
image_label() {
  docker image inspect -f "{{ index .Config.Labels \"$2\" }}" "$1" 2>/dev/null || true
}

# Tag a built and checked image ID as NAME; the image NAME named before is removed (a superseded build would linger
# untagged, a GB each time; one that a container or another tag still uses stays).
promote() {
  local id="$1" name="$2" old
  old="$(docker image inspect -f '{{.Id}}' "$name" 2>/dev/null || true)"
  docker tag "$id" "$name"
  if [ -n "$old" ] && [ "$old" != "$(docker image inspect -f '{{.Id}}' "$name")" ]; then
    docker rmi "$old" >/dev/null 2>&1 || true
  fi
}
