#!/usr/bin/env bash
# Build the project's Dockerfile on a machine without Docker or a registry, serve one chat
# request from the image, and record the result.
#
#   deploy/build_image.sh [options]        (as root)
#
#   1. base image: Debian bookworm + Python 3.11 (what python:3.11-slim-bookworm provides:
#      python3.11, venv, headers), made with mmdebstrap and `podman import`; skipped when
#      it exists already;
#   2. the image: `buildah bud --isolation chroot --layers` of the Dockerfile on that base,
#      from a clean export of the git HEAD (uncommitted edits stay out of the image);
#   3. a run: `buildah from` + `buildah run --isolation chroot` serving on 127.0.0.1:<free
#      port>; waits for GET /health 200 (the first start provisions the default model from
#      PyPI and compiles the engine: minutes), sends one POST /v1/chat/completions, checks a
#      200 with a non-empty answer, stops the server and removes the container;
#   4. prints and writes a JSON result (date, commit, image id and size, build seconds,
#      start-to-healthy seconds, the answer).
#
# Options:
#   --base IMAGE       the base image (default localhost/bookworm-py311)
#   --tag IMAGE        the built image (default localhost/rope-extend-server:cpu)
#   --context DIR      build this directory instead of an export of HEAD
#   --ca-bundle FILE   a CA bundle pip needs to reach its index (default: $PIP_CERT or
#                      $SSL_CERT_FILE if set; none otherwise)
#   --wheels DIR       a local wheel directory for pip (pip's find-links; default:
#                      $PIP_FIND_LINKS or `pip config get global.find-links` if set)
#   --no-cache         rebuild every layer (default: reuse buildah's cached layers, kept as
#                      unnamed images; `buildah rmi --prune` frees them)
#   --no-run           build only
#   --health-timeout S seconds to wait for /health (default 1800)
#   --result FILE      where the JSON goes (default deploy/image_result.json)
#   --logs DIR         where the build and server logs are kept (default /tmp/rope-image-logs)
#
# The CA bundle and the wheel directory are build- and run-time inputs only: a pip config
# naming them is mounted with --volume (PIP_CONFIG_FILE, a build argument of the build
# stage) and never copied into the image; at run time only the CA bundle is mounted, for
# the default model's `pip download`.
#
# Needs: root; Debian's mmdebstrap, podman and buildah (installed with apt-get if missing);
# curl and python3 on the host.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BASE="localhost/bookworm-py311"
TAG="localhost/rope-extend-server:cpu"
CONTEXT=""
CA_BUNDLE="${PIP_CERT:-${SSL_CERT_FILE:-}}"
WHEELS="${PIP_FIND_LINKS:-}"
RUN=1
CACHE=""
HEALTH_TIMEOUT=1800
RESULT="$ROOT/deploy/image_result.json"
LOGS="/tmp/rope-image-logs"
MODEL="SmolLM2-135M-Instruct"

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
while (($#)); do
    case "$1" in
        --base) BASE="$2"; shift 2 ;;
        --tag) TAG="$2"; shift 2 ;;
        --context) CONTEXT="$2"; shift 2 ;;
        --ca-bundle) CA_BUNDLE="$2"; shift 2 ;;
        --wheels) WHEELS="$2"; shift 2 ;;
        --no-run) RUN=0; shift ;;
        --no-cache) CACHE="--no-cache"; shift ;;
        --health-timeout) HEALTH_TIMEOUT="$2"; shift 2 ;;
        --result) RESULT="$2"; shift 2 ;;
        --logs) LOGS="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
    esac
done

log() { printf '[build_image %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { log "FAILED: $*"; exit 1; }

[[ $EUID -eq 0 ]] || die "run as root (mmdebstrap, podman import and buildah's chroot isolation need it)"
missing=()
for tool in mmdebstrap podman buildah; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
    log "installing ${missing[*]} with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
for tool in curl python3; do command -v "$tool" >/dev/null || die "$tool is needed on the host"; done

if [[ -z "$WHEELS" ]] && command -v pip >/dev/null; then
    WHEELS="$(pip config get global.find-links 2>/dev/null || true)"
fi
[[ -z "$CA_BUNDLE" || -f "$CA_BUNDLE" ]] || die "no CA bundle at $CA_BUNDLE"
[[ -z "$WHEELS" || -d "$WHEELS" ]] || WHEELS=""   # a URL or a missing directory: not mounted

WORK="$(mktemp -d /tmp/rope-image.XXXXXX)"
mkdir -p "$LOGS"
CONTAINER=""
SERVER_PID=""
cleanup() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
    fi
    if [[ -n "$CONTAINER" ]]; then
        buildah rm "$CONTAINER" >/dev/null 2>&1 && log "removed container $CONTAINER"
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

# -- pip's inputs, mounted read-only: a config, the CA bundle, the wheel directory ---------
# Mounted on /mnt, which the base image has (empty): a mount on a missing path would leave
# its empty mount point in the image.
PIPDIR="$WORK/pip"
mkdir -p "$PIPDIR/wheels"
build_volumes=(--volume "$PIPDIR:/mnt:ro")
run_volumes=()
{
    echo "[global]"
    if [[ -n "$CA_BUNDLE" ]]; then
        cp "$CA_BUNDLE" "$PIPDIR/ca.crt"
        echo "cert = /mnt/ca.crt"
    fi
    if [[ -n "$WHEELS" ]]; then
        echo "find-links = /mnt/wheels"
        build_volumes+=(--volume "$WHEELS:/mnt/wheels:ro")
    fi
} > "$PIPDIR/build.conf"
{
    echo "[global]"
    [[ -z "$CA_BUNDLE" ]] || echo "cert = /mnt/ca.crt"
} > "$PIPDIR/run.conf"
chmod -R a+rX "$WORK"   # the server runs as the image's user 10001
run_volumes+=(--volume "$PIPDIR:/mnt:ro")
log "pip inputs: CA bundle ${CA_BUNDLE:-none}, wheel directory ${WHEELS:-none} (mounted, not copied in)"

# -- 1. the base image ------------------------------------------------------------------------
if podman image exists "$BASE"; then
    log "base image $BASE exists"
else
    log "building base image $BASE with mmdebstrap (Debian bookworm, Python 3.11)"
    mmdebstrap --quiet --variant=minbase \
        --include=python3.11,python3.11-venv,python3.11-dev,ca-certificates \
        bookworm "$WORK/rootfs.tar" \
        "deb http://deb.debian.org/debian bookworm main" \
        "deb http://deb.debian.org/debian bookworm-updates main" \
        "deb http://deb.debian.org/debian-security bookworm-security main"
    podman import --quiet --change 'CMD ["/bin/bash"]' "$WORK/rootfs.tar" "$BASE" >/dev/null
    rm -f "$WORK/rootfs.tar"
    log "base image $BASE: $(podman image inspect --format '{{.Size}}' "$BASE") bytes"
fi

# -- 2. the image -----------------------------------------------------------------------------
COMMIT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [[ -z "$CONTEXT" ]]; then
    CONTEXT="$WORK/context"
    mkdir -p "$CONTEXT"
    git -C "$ROOT" archive HEAD | tar -x -C "$CONTEXT"
    log "build context: git HEAD $COMMIT"
else
    COMMIT="$COMMIT+context:$CONTEXT"
    log "build context: $CONTEXT"
fi
log "building $TAG (buildah bud --isolation chroot; the first build installs vLLM: minutes)"
build_start=$(date +%s)
set +e   # the full log goes to $LOGS/build.log; the steps and the install's own lines to the terminal
buildah bud --isolation chroot --layers ${CACHE:+"$CACHE"} \
    --build-arg BASE_IMAGE="$BASE" \
    --build-arg PIP_CONFIG_FILE=/mnt/build.conf \
    "${build_volumes[@]}" \
    -f "$CONTEXT/Dockerfile" -t "$TAG" "$CONTEXT" 2>&1 | tee "$LOGS/build.log" \
    | grep --line-buffered -E '^(STEP|COMMIT|install:|decode kernel|Successfully tagged|ERROR|error)'
status=${PIPESTATUS[0]}
set -e
((status == 0)) || { tail -40 "$LOGS/build.log"; die "buildah bud exited with $status"; }
build_seconds=$(($(date +%s) - build_start))
IMAGE_ID="$(podman image inspect --format '{{.Id}}' "$TAG")"
IMAGE_SIZE="$(podman image inspect --format '{{.Size}}' "$TAG")"
gb() { awk -v b="$1" 'BEGIN { printf "%.2f GB", b / 1e9 }'; }   # as `podman images` shows it
log "built $TAG in ${build_seconds}s: id ${IMAGE_ID:0:12}, $(gb "$IMAGE_SIZE")"

write_result() {
    python3 - "$RESULT" "$@" <<'EOF'
import json, sys
path, *pairs = sys.argv[1:]
result = {}
for pair in pairs:
    key, _, value = pair.partition("=")
    result[key] = int(value) if key.endswith(("_seconds", "_bytes")) else value
with open(path, "w") as f:
    json.dump(result, f, indent=2)
    f.write("\n")
print(json.dumps(result, indent=2))
EOF
}
common=(date="$(date -u +%Y-%m-%dT%H:%M:%SZ)" commit="$COMMIT" base_image="$BASE" image="$TAG"
        image_id="$IMAGE_ID" image_size_bytes="$IMAGE_SIZE" image_size="$(gb "$IMAGE_SIZE")"
        build_seconds="$build_seconds" build_cache="$([[ -n "$CACHE" ]] && echo none || echo "buildah's layers")" buildah="$(buildah --version | awk '{print $3}')")
if ((!RUN)); then
    write_result "${common[@]}"
    exit 0
fi

# -- 3. run it --------------------------------------------------------------------------------
PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
CONTAINER="$(buildah from --name "rope-extend-run-$$" "$TAG")"
MODELS="$WORK/models"
mkdir -p "$MODELS" && chown 10001 "$MODELS"
log "checking the C++ decode kernel in the image (built by install.sh, loaded as user 10001)"
kernel="$(buildah run --isolation chroot "$CONTAINER" -- python -m rope_plugins.ops.native 2>&1 | tail -1)"
[[ "$kernel" == "decode kernel: ready" ]] || die "$kernel"
log "starting $CONTAINER on 127.0.0.1:$PORT (server log: $LOGS/server.log)"
start=$(date +%s)
setsid buildah run --isolation chroot \
    "${run_volumes[@]}" --volume "$MODELS:/models" \
    --env PIP_CONFIG_FILE=/mnt/run.conf \
    --env ROPE_EXTEND_HOST=127.0.0.1 --env ROPE_EXTEND_PORT="$PORT" \
    "$CONTAINER" -- python -m rope_plugins.server > "$LOGS/server.log" 2>&1 &
SERVER_PID=$!
url="http://127.0.0.1:$PORT"
last=""
while true; do
    code="$(curl -s -o /dev/null -w '%{http_code}' "$url/health" || true)"
    [[ "$code" == "200" ]] && break
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -40 "$LOGS/server.log"; die "the server exited before /health answered 200"; }
    (($(date +%s) - start < HEALTH_TIMEOUT)) || { tail -40 "$LOGS/server.log"; die "no /health 200 after ${HEALTH_TIMEOUT}s"; }
    line="$(tail -1 "$LOGS/server.log" | cut -c1-150)"
    if [[ "$line" != "$last" ]]; then log "  waiting ($(($(date +%s) - start))s, /health $code): $line"; last="$line"; fi
    sleep 5
done
healthy_seconds=$(($(date +%s) - start))
log "healthy after ${healthy_seconds}s"

log "POST /v1/chat/completions"
body='{"model": "'"$MODEL"'", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16, "temperature": 0}'
code="$(curl -s -o "$WORK/chat.json" -w '%{http_code}' -H 'Content-Type: application/json' -d "$body" "$url/v1/chat/completions")"
[[ "$code" == "200" ]] || { cat "$WORK/chat.json"; die "chat completion answered HTTP $code"; }
answer="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["choices"][0]["message"]["content"].strip())' "$WORK/chat.json")"
[[ -n "$answer" ]] || die "empty answer: $(cat "$WORK/chat.json")"
log "answer: $answer"

log "stopping the server (SIGTERM)"
kill -TERM -- "-$SERVER_PID"
for _ in $(seq 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
kill -0 "$SERVER_PID" 2>/dev/null && die "the server did not stop within 60s of SIGTERM"
SERVER_PID=""

write_result "${common[@]}" start_to_healthy_seconds="$healthy_seconds" \
    decode_kernel="${kernel#decode kernel: }" question="What is the capital of France?" answer="$answer"
log "done: $RESULT"
