"""kvbroker for SGLang's PD disaggregation: register a KVArgs with a broker, move requests, poll them.

SGLang is not a dependency: any object with KVArgs's attributes works. See `adapter` for the map.
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
