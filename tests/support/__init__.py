"""What the tests share: every constant, class and helper more than one module uses. Test modules
import from here, never from each other nor from a conftest (tests/test_layers.py pins it); the
conftests hold only fixtures, hooks and the environment they set, and build their fixtures from
these modules. Importing this package imports none of them.

Any suite:
    helpers          refusals, a PeerService of a test's own, a process's ports, /metrics, the CLI,
                     descriptor rows, and the bounded waits: `until` (a plain condition),
                     `until_awaited` (an async one)
    brokers          real brokers on loopback (`open_broker`, `close_broker(s)`) and engines on them
                     (`Engines`), the pool's bytes after a transfer (`expected_after`, `assert_bytes`),
                     engines in a child process: tests/conftest.py's `brokers` and `engines`; the
                     integration, unit, deploy and sglang tests
tests/integration:
    flows            real brokers driven over gRPC: grant, transfer, offer, part, watch, a call's refusal,
                     JSON log lines, the pages a destination should hold
    parts_model      the parts state machine's model of a grant (test_parts_state_machine, test_expiry_gap)
    peer_side        the peer plane beside real brokers: a PeerService answering Handshake as told,
                     a broker's real handshake, a test CA's identities
    streams          a raw Exchange stream, a client that writes until blocked, metric samples
    watch            a broker under a flood: peak RSS, health checks timed, the bound a call may take
tests/unit:
    linked_brokers   two Brokers of one process linked without gRPC or an engine (a PeerLink that calls
                     the other Broker, a memmove backend): the pipelines whole, in process
tests/client:
    pools            brokers, clients and SharedPools through the public client (tests/client/conftest.py)
    pool_engines     a small engine over a SharedPool (`pool_engine`)
tests/deploy:
    deploy           the Dockerfile, the build context and the rendered manifests, read
tests/sglang (and benchmarks/sglang_plugin_hops.py):
    sglang_ranks     SGLang's pools, KVArgs and runtime context on CPU; `Ranks`, its KV managers on brokers
    sglang_pair      one chunked request between a prefill and a decode rank, driven as the schedulers do
tests/servers and tests/vllm (real servers, minutes):
    reference        the session's non-PD SGLang server's answers (tests/conftest.py's `reference`)
    sglang_servers   SGLang PD deployments and the cases the Llama and MiniMax modules share
    vllm_servers     vLLM's reference answers, the connector's settings, `settled`, a broker restarted
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout: what tests read of it (deploy/, the proto, ...)

