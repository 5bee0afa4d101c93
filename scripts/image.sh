#!/usr/bin/env bash
# Builds kvbroker's CPU image with podman on a machine of this kind, where no image registry is
# reachable: a Debian bookworm base made locally with mmdebstrap (Debian's python3, its venv and
# certificates) and imported into podman, then the project's Dockerfile on it (PYTHON_IMAGE), every
# package from PyPI. podman, buildah, mmdebstrap and runc come from Debian when missing (as root).
# crun refuses this machine's cgroup v1 hybrid, so podman runs runc; the image is built in Docker's
# format, which keeps the HEALTHCHECK (OCI's drops it). Prints the image's size.
#
#   bash scripts/image.sh                  builds localhost/kvbroker:cpu (KVBROKER_IMAGE names another)
#   bash scripts/image.sh --base-only      the base alone
#
# Where a registry is reachable the Dockerfile builds as it is: `docker build -t kvbroker:cpu .`.
set -euo pipefail
cd "$(dirname "$0")/.."

image=${KVBROKER_IMAGE:-localhost/kvbroker:cpu}
base=${KVBROKER_BASE_IMAGE:-localhost/kvbroker-base:bookworm}
podman=(podman --runtime runc)

missing=()
for tool in podman buildah mmdebstrap runc; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if (( ${#missing[@]} )); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "image: ${missing[*]} missing; installing them needs root (apt-get install ${missing[*]})" >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman buildah mmdebstrap runc >/dev/null
fi

if ! "${podman[@]}" image exists "$base"; then
    scratch=$(mktemp -d)
    trap 'rm -rf "$scratch"' EXIT
    # minbase: dpkg, apt and the essential set; python3-venv brings ensurepip, whose pip the build uses.
    # Documentation, manuals and translations are not installed, in the base or by the build's apt
    # (dpkg keeps the exclusions in the image); the licences are.
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' bookworm "$scratch/base.tar"
    "${podman[@]}" import --quiet --change 'CMD ["python3"]' "$scratch/base.tar" "$base" >/dev/null
fi
[[ ${1:-} == --base-only ]] && exit 0

# A proxy that re-signs TLS (as here) is trusted by the host's bundle: the build's pip gets it, mounted for
# the build only, never in the image.
trust=()
bundle=${PIP_CERT:-${SSL_CERT_FILE:-}}
if [[ -n $bundle && -f $bundle ]]; then
    trust=(--volume "$bundle:/run/kvbroker-build-ca.crt:ro" --build-arg CA_BUNDLE=/run/kvbroker-build-ca.crt)
fi
"${podman[@]}" build --quiet --format docker --network=host --build-arg "PYTHON_IMAGE=$base" --build-arg FLAVOR=cpu \
    ${trust[@]+"${trust[@]}"} --tag "$image" . >/dev/null
size=$("${podman[@]}" image inspect --format '{{.Size}}' "$image")
echo "$image: $((size / 1000000)) MB"
