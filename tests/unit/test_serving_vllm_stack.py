"""The vLLM serving stack without vLLM: how it starts servers and the router (commands, environment,
connectors), how it reads a streamed completion and a server's /metrics, and how a deployment pauses
and stops its processes. The servers themselves run in the vLLM tests and benchmarks/vllm_serving.py."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvbroker_tools.launch import ChildDied
from kvbroker_tools.serving import vllm_stack
from kvbroker_tools.serving.stack import ServerProcess


@pytest.fixture
def venv(tmp_path, monkeypatch) -> Path:
    """A stand-in for .venv-vllm: only its paths are used."""
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").touch()
    monkeypatch.setenv("KVBROKER_VLLM_VENV", str(tmp_path / "venv"))
    return tmp_path / "venv"


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_a_server_is_vllms_api_server_module_in_its_own_venv_on_loopback(venv):
    config = vllm_stack.nixl_config("kv_producer")
    command = vllm_stack.server_command(Path("/m"), 8123, config, ("--max-num-seqs", "4"))
    assert command[:3] == [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert (flag(command, "--model"), flag(command, "--port"), flag(command, "--host")) == ("/m", "8123", "127.0.0.1")
    assert json.loads(flag(command, "--kv-transfer-config")) == config
    assert command[-2:] == ["--max-num-seqs", "4"]  # the caller's arguments last: they win
    assert "--kv-transfer-config" not in vllm_stack.server_command(Path("/m"), 8123)


def test_a_missing_vllm_venv_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBROKER_VLLM_VENV", str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match="scripts/setup.sh --test"):
        vllm_stack.server_command(Path("/m"), 1)


def test_the_router_runs_pd_over_both_servers_on_loopback(venv):
    prefill = ServerProcess("prefill", None, "http://127.0.0.1:1001", Path("p.log"), [], {})  # type: ignore[arg-type]
    decode = ServerProcess("decode", None, "http://127.0.0.1:1002", Path("d.log"), [], {})  # type: ignore[arg-type]
    command = vllm_stack.router_command(prefill, decode, 9000)
    assert command[0] == str(venv / "bin" / "vllm-router") and "--vllm-pd-disaggregation" in command
    assert (flag(command, "--prefill"), flag(command, "--decode")) == (prefill.url, decode.url)
    assert flag(command, "--host") == flag(command, "--prometheus-host") == "127.0.0.1"
    assert flag(command, "--port") == "9000" and flag(command, "--prometheus-port") != "29000"


def test_servers_run_vllms_environment_not_the_callers_python_path(venv, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/site")
    env = vllm_stack.server_env({"OMP_NUM_THREADS": "2", "EXTRA": "1"})
    assert "PYTHONPATH" not in env
    assert env["PATH"].split(":")[0] == str(venv / "bin") and env["VIRTUAL_ENV"] == str(venv)
    assert env["OMP_NUM_THREADS"] == "2" and env["EXTRA"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["UCX_NET_DEVICES"] == "lo"


def test_nixl_connector_gives_each_side_its_role_and_its_own_side_channel():
    connector = vllm_stack.nixl_connector()
    assert (connector.prefill_config["kv_role"], connector.decode_config["kv_role"]) == ("kv_producer", "kv_consumer")
    for config in (connector.prefill_config, connector.decode_config):
        assert config["kv_connector"] == "NixlConnector" and config["kv_buffer_device"] == "cpu"
    sides = (connector.prefill_env, connector.decode_env)
    assert {env["VLLM_NIXL_SIDE_CHANNEL_HOST"] for env in sides} == {"127.0.0.1"}
    assert sides[0]["VLLM_NIXL_SIDE_CHANNEL_PORT"] != sides[1]["VLLM_NIXL_SIDE_CHANNEL_PORT"]


def test_a_completion_request_is_greedy_streamed_and_asks_for_token_ids():
    body = vllm_stack.completion_body([5, 6], 4, kv_transfer_params={"do_remote_decode": True})
    assert body == {"prompt": [5, 6], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
                    "return_token_ids": True, "kv_transfer_params": {"do_remote_decode": True}}


async def completions_server(chunks: list[bytes], status: int = 200):
    """An HTTP endpoint that streams `chunks` as vLLM's /v1/completions streams (one per SSE event)."""
    async def completions(request: web.Request) -> web.StreamResponse:
        if status != 200:
            return web.Response(status=status, text="no such model")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks:
            await response.write(b"data: " + chunk + b"\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def chunk(*ids: int) -> bytes:
    return json.dumps({"choices": [{"index": 0, "text": "", "token_ids": list(ids)}]}).encode()


async def test_a_streamed_completion_is_its_chunks_token_ids_in_order():
    runner, url = await completions_server([chunk(), chunk(7), chunk(8, 9), chunk(), b"[DONE]"])
    try:
        async with aiohttp.ClientSession() as http:
            answer = await vllm_stack.complete(http, url, [1, 2, 3], 3, timeout=30)
    finally:
        await runner.cleanup()
    assert answer.output_ids == [7, 8, 9]
    assert 0 < answer.ttft_s <= answer.latency_s


@pytest.mark.parametrize(("chunks", "status", "said"), [
    ([chunk(7)], 404, "HTTP 404: no such model"),
    ([json.dumps({"error": {"message": "KV load failed"}}).encode()], 200, "KV load failed"),
    ([chunk(), b"[DONE]"], 200, "ended without a token"),
])
async def test_a_refused_or_empty_completion_raises_saying_why(chunks, status, said):
    runner, url = await completions_server(chunks, status)
    try:
        async with aiohttp.ClientSession() as http:
            with pytest.raises(RuntimeError, match=said):
                await vllm_stack.complete(http, url, [1], 1, timeout=30)
    finally:
        await runner.cleanup()


def test_prompt_sources_sums_each_source_over_every_label_set():
    metrics = "\n".join([
        "# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.",
        "# TYPE vllm:prompt_tokens_by_source_total counter",
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 8.0',
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 400.0',
        'vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="external_kv_transfer"} 32.0',
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 440.0',
    ])
    assert vllm_stack.prompt_sources(metrics) == {"local_compute": 8.0, "external_kv_transfer": 432.0}


# A leader that starts a child in its process group, as a vLLM server starts its engine core.
FAMILY = ("import subprocess, sys, time; "
          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
          "print(child.pid, flush=True); time.sleep(120)")


def state(pid: int) -> str:
    """The process's state letter from /proc (R, S, T for stopped, Z), or "gone" once it was reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


async def family(name: str, tmp_path: Path) -> tuple[ServerProcess, int]:
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", FAMILY, stdout=asyncio.subprocess.PIPE,
                                                   start_new_session=True)
    child = int(await asyncio.wait_for(process.stdout.readline(), 30))
    return ServerProcess(name, process, "http://127.0.0.1:1", tmp_path / f"{name}.log", [], {}), child


async def states(pids: list[int], want: str, timeout: float = 10.0) -> set[str]:
    """Each process's state once all are `want` or `timeout` passed (a signal lands when its target is
    next scheduled: polled, not assumed)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        seen = {state(pid) for pid in pids}
        if seen == {want} or loop.time() > deadline:
            return seen
        await asyncio.sleep(0.01)


@pytest.fixture
async def deployment(tmp_path):
    made = [await family(role, tmp_path) for role in ("router", "prefill", "decode")]
    pd = vllm_stack.Deployment("pd", made[0][0].url, {server.name: server for server, _ in made})
    pd.children = [child for _, child in made]
    try:
        yield pd
    finally:
        pd.resume()
        for server in pd.servers.values():
            await server.kill()


async def test_a_deployment_pauses_and_resumes_every_process_of_every_server(deployment):
    pids = [s.pid for s in deployment.servers.values()] + deployment.children
    deployment.pause()
    assert await states(pids, "T") == {"T"}
    deployment.resume()
    assert "T" not in await states(pids, "S")


async def test_a_paused_deployment_stops_whole(deployment):
    deployment.pause()
    await asyncio.wait_for(deployment.stop(), 60)
    assert all(s.process.returncode is not None for s in deployment.servers.values())
    assert await states(deployment.children, "gone", timeout=30) == {"gone"}


async def test_stop_names_a_server_that_had_died_unasked_and_stops_the_others(deployment):
    decode = deployment.servers["decode"]
    decode._signal_group(signal.SIGKILL)
    await decode.process.wait()
    with pytest.raises(ChildDied, match="decode"):
        await asyncio.wait_for(deployment.stop(), 60)
    assert all(s.process.returncode is not None for s in deployment.servers.values())


def test_metrics_are_read_by_sample_name_and_summed_over_labels():
    text = """# HELP vllm:num_requests_running Number of requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} 96.0
vllm:prompt_tokens_by_source_total{source="local_compute"} 4.0
vllm:prompt_tokens_by_source_created{source="local_compute"} 1.7e9
"""
    assert vllm_stack.metric_sum(text, "vllm:num_requests_running") == 3.0
    assert vllm_stack.metric_sum(text, "vllm:num_requests_waiting") == 0.0
    assert vllm_stack.prompt_sources(text) == {"external_kv_transfer": 96.0, "local_compute": 4.0}


async def test_a_servers_ipc_sockets_live_in_a_directory_of_its_own_removed_once_it_ended(venv, tmp_path, monkeypatch):
    """vLLM names its ZMQ sockets in VLLM_RPC_BASE_PATH (the temporary directory by default) and leaves
    them there: every server started here gets a directory of its own, gone once the server ended."""
    child = tmp_path / "server.py"  # binds a socket where vLLM would, then answers /health as vLLM's server does
    child.write_text("""import os, socket, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
sock = socket.socket(socket.AF_UNIX)
sock.bind(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], "engine-core"))
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
""")
    monkeypatch.setattr(vllm_stack, "server_command", lambda _model, port, *_: [sys.executable, str(child), str(port)])
    servers = [await vllm_stack.start_server(name, Path("model"), tmp_path, timeout=60) for name in ("a", "b")]
    scratches = [server.scratch for server in servers]
    assert None not in scratches and scratches[0] != scratches[1]
    assert [server.env["VLLM_RPC_BASE_PATH"] for server in servers] == [str(s) for s in scratches]
    assert all((scratch / "engine-core").is_socket() for scratch in scratches)
    await servers[0].kill()
    await servers[1].stop(timeout=5)
    assert not any(scratch.exists() for scratch in scratches)
