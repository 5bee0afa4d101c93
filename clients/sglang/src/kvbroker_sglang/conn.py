"""kvbroker as an SGLang 0.5.23 transfer backend: the classes `get_kv_class(TransferBackend.KVBROKER, ...)` returns.

SGLang's scheduler calls these synchronously, from its event loop. Each KV manager holds an
EngineLink (kvbroker_client.adapter: a session to the broker in its pod, on a loop thread of its
own) and one request of the adapter core per room, so no call here waits on the network except
the bounded ones at startup and shutdown.

    KvbrokerKVManager           manager.py: a PrefillKVManager (prefill.py) or a DecodeKVManager
                                (decode.py), chosen by SGLang's mode
    KvbrokerKVSender            prefill.py: a room's chunks as parts
    KvbrokerKVReceiver          decode.py: a room's grant, offered to the prefill rank's broker
    KvbrokerKVBootstrapServer   bootstrap.py: SGLang's /route rows with each rank's broker
    KvbrokerTransferError       the failure SGLang raises, with the broker's status code
Discovery is SGLang's own (bootstrap server, ZMQ frames: wire.py); SGLang's private surface is used
in sglang_0_5_23.py only. The request flow, role by role, is in prefill.py and decode.py.
"""

from kvbroker_sglang.bootstrap import KvbrokerKVBootstrapServer
from kvbroker_sglang.decode import DecodeKVManager, KvbrokerKVReceiver
from kvbroker_sglang.manager import KvbrokerKVManager, KvbrokerTransferError
from kvbroker_sglang.prefill import KvbrokerKVSender, PrefillKVManager

__all__ = ["DecodeKVManager", "KvbrokerKVBootstrapServer", "KvbrokerKVManager", "KvbrokerKVReceiver",
           "KvbrokerKVSender", "KvbrokerTransferError", "PrefillKVManager"]
