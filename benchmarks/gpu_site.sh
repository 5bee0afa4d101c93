#!/usr/bin/env bash
# Packs what benchmarks/gpu_check.py needs beyond the lent GPU machine's image (Python 3.12 with a
# CUDA torch, numpy, uvloop and prometheus-client; nothing can be fetched there) into
# .gpu/site.tar.gz, for the device tool's `carry`: kvbroker's Python dependencies at the versions
# of this checkout's .venv, and NIXL's CUDA 13 wheel without its expert-parallel kernels (nixl_ep,
# about 95 MB the check never loads), so that the tree and the archive stay within the tool's 64 MiB.
# It also builds kvbroker/memory/_memguard for Python 3.12 (the device's). Run here, in the repository
# root's shell, with network; then on the device (one `run` command, carrying both, RESULTS.md):
#   mkdir -p /tmp/site && tar xzf .gpu/site.tar.gz -C /tmp/site && export PYTHONPATH=/tmp/site && ...
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qsx '/.gpu/' .git/info/exclude || echo '/.gpu/' >>.git/info/exclude

pins() {  # name==version as this checkout's .venv has them
    .venv/bin/python -m pip freeze 2>/dev/null | grep -i -E "^($(IFS='|'; echo "$*"))==" ; }
names=(nixl nixl-cu13 grpcio grpcio-health-checking grpcio-reflection protobuf pydantic pydantic-settings
       pydantic-core annotated-types typing-inspection typing-extensions python-dotenv)
mapfile -t wanted < <(pins "${names[@]//-/[-_]}")
(( ${#wanted[@]} == ${#names[@]} )) || { echo "gpu_site: .venv lacks some of ${names[*]}" >&2; exit 1; }

rm -rf .gpu/site .gpu/site.tar.gz
mkdir -p .gpu/wheels .gpu/site
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .gpu/wheels "${wanted[@]}"
.venv/bin/python -m pip install -q --no-deps --no-index --no-compile --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" --find-links .gpu/wheels --target .gpu/site "${wanted[@]}"
rm -rf .gpu/site/nixl_ep_cu13 .gpu/site/nixl_cu13.libs/ucx/libucx_perftest* .gpu/site/bin
tar czf .gpu/site.tar.gz -C .gpu/site .
echo "gpu_site: .gpu/site.tar.gz $(du -m .gpu/site.tar.gz | cut -f1) MiB (${wanted[*]})"

# The SIGBUS guard is kvbroker's one compiled part (setup.py): built here for Python 3.12, beside the
# 3.11 build, and carried by its own path (it is ignored, *.so), since the lent machine has no
# Python headers to build it with.
py312=
for candidate in python3.12 /root/.pyenv/versions/3.12.*/bin/python3.12; do  # a pyenv shim may not run
    if "$candidate" -c '' 2>/dev/null; then py312=$candidate; break; fi
done
[[ -n $py312 ]] || { echo "gpu_site: no python3.12 here to build kvbroker/memory/_memguard for the device" >&2; exit 1; }
include=$("$py312" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$("$py312" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
[[ $suffix == .cpython-312-x86_64-linux-gnu.so ]] || { echo "gpu_site: $py312 builds $suffix" >&2; exit 1; }
gcc -shared -fPIC -std=gnu11 -O2 -Wall -Werror -I"$include" kvbroker/memory/_memguard.c \
    -o "kvbroker/memory/_memguard$suffix"
echo "gpu_site: kvbroker/memory/_memguard$suffix (carry it too)"
