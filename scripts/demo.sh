#!/usr/bin/env bash
# Sets up kvbroker and runs `kvbroker demo`: a prefill and a decode broker, one MiniMax-M3-shaped
# request moved through NIXL and verified to the byte. Extra arguments go to the demo
# (e.g. --preset large, --backend mooncake).
#
# With --sglang first: the real PD deployment instead (SGLang 0.5.23's router, a prefill and a
# decode server, a kvbroker broker per server; a tiny Llama built locally), one request, its answer
# and time to first token beside SGLang's own mooncake backend (tooling/src/kvbroker_tools/serving/demo.py;
# extra arguments go to it, e.g. --engine mooncake). It installs SGLang with the test tools.
# With --vllm first: vLLM 0.32's PD deployment with kvbroker's connector (vllm-router, a prefill and a
# decode server, a broker each) beside a non-PD vLLM server (tooling/src/kvbroker_tools/serving/vllm_demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--vllm" ]]; then
    shift
    scripts/setup.sh --test
    exec scripts/in-netns.sh .venv/bin/python -m kvbroker_tools.serving.vllm_demo "$@"
fi
if [[ "${1:-}" == "--sglang" ]]; then
    shift
    scripts/setup.sh --test
    exec scripts/in-netns.sh .venv/bin/python -m kvbroker_tools.serving.demo "$@"
fi
scripts/setup.sh
exec scripts/in-netns.sh .venv/bin/kvbroker demo "$@"
