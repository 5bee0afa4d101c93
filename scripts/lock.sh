#!/usr/bin/env bash
# Moves the locks forward: compiles every lock in locks/ anew from its .in file and the packages'
# pyproject.toml (the newest releases their ranges allow), then reinstalls (scripts/setup.sh --test)
# and runs the whole suite (scripts/test.sh). Commit the lock change on its own once the suite passed.
#
#   bash scripts/lock.sh                 upgrade every lock, reinstall, run the suite
#   bash scripts/lock.sh -P grpcio       upgrade only the packages named (uv's --upgrade-package)
#   bash scripts/lock.sh --keep          after an .in or pyproject change: keep every pin that still fits
#   bash scripts/lock.sh --no-test ...   compile only
#   bash scripts/lock.sh --check         exit 1 if a lock is not what its inputs compile to (scripts/test.sh)
# Arguments after -- go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

upgrade=(--upgrade)
run_tests=1
out=locks
while [[ $# -gt 0 ]]; do
    case "$1" in
        --keep) upgrade=(); shift ;;
        -P) [[ "${upgrade[0]:-}" == --upgrade ]] && upgrade=(); upgrade+=(--upgrade-package "$2"); shift 2 ;;
        --no-test) run_tests=0; shift ;;
        --check) upgrade=(); run_tests=0; out=$(mktemp -d); trap 'rm -rf "$out"' EXIT; cp locks/*.txt "$out"; shift ;;
        --) shift; break ;;
        *) echo "lock.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

compile() {  # compile LOCK [uv flags]: locks/LOCK.in -> LOCK.txt, for CPython 3.11 on glibc 2.36 (Debian 12)
    local name=$1; shift
    scripts/uv.sh pip compile "locks/$name.in" -o "$out/$name.txt" --quiet --generate-hashes \
        --python-version 3.11 --python-platform x86_64-manylinux_2_36 \
        --no-emit-package kvbroker --no-emit-package kvbroker-client --no-emit-package kvbroker-sglang \
        --no-emit-package kvbroker-tools \
        --custom-compile-command "bash scripts/lock.sh" ${upgrade[@]+"${upgrade[@]}"} "$@"
}
compile uv
compile runtime-cpu
compile runtime-cuda
compile image-cpu --override locks/image-cpu.overrides  # the CPU image: no torch (image-cpu.in)
compile test            # constrained by runtime-cpu.txt: the suite runs what the demo and image run
compile sglang-nodeps --no-deps
compile vllm --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec  # CUDA builds: stop `import vllm`

if [[ $out != locks ]]; then  # --check: the same pins (hashes may grow as wheels are added upstream)
    stale=()
    for lock in locks/*.txt; do
        diff -q <(grep -E '^[A-Za-z0-9]' "$lock") <(grep -E '^[A-Za-z0-9]' "$out/${lock##*/}") >/dev/null \
            || stale+=("$lock")
    done
    if (( ${#stale[@]} )); then
        echo "lock.sh: not what their inputs compile to: ${stale[*]}; run bash scripts/lock.sh --keep" >&2
        exit 1
    fi
    exit 0
fi
git --no-pager diff --stat -- locks/
(( run_tests )) || exit 0
exec bash scripts/test.sh "$@"
