"""The engine-neutral adapter core: what every engine adapter (kvbroker_sglang, kvbroker_vllm) needs
that is not its engine's. An adapter maps its engine's calls onto these and their phases back onto
its engine's; it holds no BrokerClient and no request state of its own (tests/test_layers.py).

    settings.AdapterSettings      the broker address and the bounds, from the environment
    link.EngineLink               one engine (rank) on its broker: connect, register, the loop, close
    sending.SendingRequest, Part  the sender's request: the offer's watch, parts in order, cancel
    receiving.ReceivingRequest    the receiver's request: the grant offered, its watch, the aux, cancel
    phases.Phase, Failure         OPEN -> WAITING -> TRANSFERRING -> SUCCEEDED | FAILED; code and reason
    memory.MemoryExporter         addresses -> memory references a broker opens (/dev/shm, CUDA IPC)
    hostmem                       host tensors moved into /dev/shm in place (torch; import it yourself)
    aux                           the aux framing (KVBA v1): host metadata rows as bytes
    loop.LoopThread               the asyncio loop beside an engine's synchronous thread

Threads: engine threads call `open`, `send_part`, `grant`, `cancel`, `fail` and read `phase`,
`failure`, `holding`; everything that waits runs on the link's loop, and phase changes reach the
adapter through `on_change`, called on the loop.
"""

from kvbroker_client.adapter.link import EngineLink
from kvbroker_client.adapter.phases import Failure, Phase
from kvbroker_client.adapter.receiving import ReceivingRequest
from kvbroker_client.adapter.sending import Part, SendingRequest
from kvbroker_client.adapter.settings import AdapterSettings

__all__ = ["AdapterSettings", "EngineLink", "Failure", "Part", "Phase", "ReceivingRequest", "SendingRequest"]
