"""kvbroker for SGLang's PD disaggregation.

    plugin    the `sglang.srt.plugins` entry point: `--disaggregation-transfer-backend kvbroker`
    conn      the manager, sender, receiver and bootstrap server SGLang 0.5.23 runs (imports sglang)
    layout    KVArgs -> components; memory: pointers -> shared-memory / CUDA IPC references
    aux       SGLang's metadata rows as the aux payload; wire: the ZMQ frames decode sends prefill
    adapter   the older helper: a KVArgs-shaped object on a BrokerClient, without SGLang

Only `conn` (and `plugin.load`) import SGLang; the rest works without it.
"""

from kvbroker_sglang.adapter import (
    STATE_COMPONENTS,
    KVPoll,
    SGLangEngine,
    engine_components,
    kv_poll,
    main_kv_component,
    state_components,
)

__all__ = ["STATE_COMPONENTS", "KVPoll", "SGLangEngine", "engine_components", "kv_poll", "main_kv_component",
           "state_components"]
