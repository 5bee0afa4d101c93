"""vLLM 0.32's own servers for the vLLM tests (tests/vllm), started as users start them
(tooling/src/kvbroker_tools/serving/vllm_stack.py; .venv-vllm, built by scripts/setup.sh --test):
`Reference`, the non-PD server's greedy answers; what kvbroker's connector is told (`CONNECTOR`);
`settled`, checked after every case; `restart_broker`; `switch_backend`, both brokers moved to another
transfer engine; `run_in_vllm`, a script in vLLM's environment.
tests/vllm/conftest.py's fixtures start the servers.

Every case leaves both servers serving and both brokers holding no request (`settled`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from kvbroker_tools.launch import BrokerProcess, start_broker, start_brokers, stop_all
from kvbroker_tools.serving import client, stack, vllm_stack
from tests.support.helpers import json_of_child, serving, until_awaited
from tests.support.reference import ANSWER_TOKENS

BLOCK = 32  # vllm_stack's --block-size
# prefill holds a request's blocks this long for decode's offer; decode's grant lives this long
CONNECTOR = {"hold_s": 60, "grant_expiry_s": 60}


class Reference:
    """The non-PD vLLM server and its greedy answers, by prompt."""

    def __init__(self, deployment: vllm_stack.Deployment, http: aiohttp.ClientSession) -> None:
        self.deployment = deployment
        self._http = http
        self._answers: dict[tuple[int, ...], list[int]] = {}

    async def answer(self, prompt: list[int], tokens: int = ANSWER_TOKENS) -> list[int]:
        key = (*prompt, -tokens)
        if key not in self._answers:
            got = await vllm_stack.complete(self._http, self.deployment.url, prompt, tokens)
            self._answers[key] = got.output_ids
        return self._answers[key]


class Starting:
    """The session's vLLM servers starting in the background: the non-PD reference and the PD pair with
    kvbroker's connector (brokers on NIXL, up before either task begins), together. On 2 cores three
    starts at once end minutes sooner than one after the other, and the fleet starts SGLang's servers
    on these brokers meanwhile."""

    def __init__(self, model: Path, log_root: Path, brokers: dict[str, BrokerProcess]) -> None:
        self.brokers = brokers
        connector = vllm_stack.kvbroker_connector(brokers["prefill"], brokers["decode"], name="kvbroker-pd",
                                                  **CONNECTOR)
        self.reference = asyncio.ensure_future(vllm_stack.start_reference(model, log_root / "reference"))
        # start_pd owns the brokers from here: a failed start stops them, the pair's stop too
        self.pair = asyncio.ensure_future(vllm_stack.start_pd(model, log_root / "pd", connector, brokers=brokers))

    @classmethod
    async def begin(cls, model: Path, log_root: Path) -> Starting:
        prefill, decode = await start_brokers(*(start_broker(f"vllm-{side}", "--backend", "nixl",
                                                             log_file=log_root / "pd" / f"broker-{side}.log")
                                                for side in ("prefill", "decode")))
        return cls(model, log_root, {"prefill": prefill, "decode": decode})

    async def stop(self) -> None:
        """Stop what started; a start still running is cancelled (its own clean-up stops its part)."""
        for task in (self.reference, self.pair):
            task.cancel()
        await asyncio.gather(self.reference, self.pair, return_exceptions=True)
        started = [t.result() for t in (self.pair, self.reference) if not t.cancelled() and t.exception() is None]
        for deployment in started:
            await deployment.stop()
        if self.pair.cancelled():  # perhaps before its first step, which would have taken the brokers
            await stop_all(self.brokers.values())


async def brokers_hold(deployment: vllm_stack.Deployment) -> dict[str, dict[str, int]]:
    return {side: await stack.broker_holds(broker) for side, broker in deployment.brokers.items()}


async def settled(deployment: vllm_stack.Deployment, reference: Reference, http: aiohttp.ClientSession) -> None:
    """After a case: both brokers hold no request and keep their engine, and a fresh request through
    the router answers as the reference does."""
    async def idle():
        held = await brokers_hold(deployment)
        return held if all(h["live_requests"] == 0 for h in held.values()) else None

    held = await until_awaited(idle, timeout=120)
    assert held, f"a broker still holds requests: {await brokers_hold(deployment)}"
    assert all(h["engines"] == 1 for h in held.values()), f"an engine is missing: {held}"

    async def servers_hold():
        return {side: await vllm_stack.held(http, deployment.servers[side].url) for side in ("prefill", "decode")}

    async def servers_idle():  # prefill holds a request's blocks at most hold_s without decode's offer
        now = await servers_hold()
        return now if all(not any(h.values()) for h in now.values()) else None

    idle_servers = await until_awaited(servers_idle, timeout=CONNECTOR["hold_s"] + 60)
    assert idle_servers, f"a server still holds requests or blocks: {await servers_hold()}"
    prompt = client.prompts(1, 3 * BLOCK + 5, seed=20_000)[0]
    got = await vllm_stack.complete(http, deployment.url, prompt, ANSWER_TOKENS)
    assert got.output_ids == await reference.answer(prompt), "the settling request"
    assert all(s.alive() for s in deployment.servers.values())


async def restart_broker(deployment: vllm_stack.Deployment, side: str, backend: str) -> BrokerProcess:
    """The broker beside `side` stopped and started again on the same addresses (its log beside the servers')."""
    old = deployment.brokers[side]
    await old.stop()
    log_file = deployment.servers[side].log_path.parent / f"broker-{side}.log"
    deployment.brokers[side] = await start_broker(old.broker_id, "--backend", backend, "--listen", old.listen,
                                                  "--peer-listen", old.peer_listen, log_file=log_file)
    return deployment.brokers[side]


async def switch_backend(deployment: vllm_stack.Deployment, backend: str) -> None:
    """Both brokers on transfer engine `backend`: restarted with it on the same addresses unless they run
    it already; back once each holds its server's engine again. The whole transfer is the brokers': one
    deployment serves the cases on each engine in turn, and the servers (minutes to start) start once."""
    held = await serving(deployment.brokers.values(), backend, timeout=0)
    if all(got[0] == backend for got in held.values()):
        return
    await asyncio.gather(*(restart_broker(deployment, side, backend) for side in ("prefill", "decode")))
    held = await serving(deployment.brokers.values(), backend)
    assert all(got == (backend, 1) for got in held.values()), f"the brokers on {backend}: {held}"


async def run_in_vllm(script: Path, *args: str, timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run `script` with vLLM's Python (`env` over vLLM's server environment); the JSON of its last line.
    A child past `timeout` is killed with the case; one that fails says its exit code and stderr."""
    return await json_of_child(script.name, str(vllm_stack.python()), str(script), *args, timeout=timeout,
                               env={**vllm_stack.server_env(), **(env or {})})
