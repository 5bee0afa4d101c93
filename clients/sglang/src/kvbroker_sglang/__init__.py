"""kvbroker for SGLang's PD disaggregation.

    plugin    the `sglang.srt.plugins` entry point: `--disaggregation-transfer-backend kvbroker`
    conn      the manager, sender, receiver and bootstrap server SGLang 0.5.23 runs (imports sglang)
    layout    KVArgs -> components; memory: pointers -> shared-memory / CUDA IPC references
    host_pools  SGLang's CPU KV pools built in /dev/shm (the plugin's hook on SGLang's pool construction)
    aux       SGLang's metadata rows as the aux payload; wire: the ZMQ frames decode sends prefill

Only `conn` (and `plugin.load`) import SGLang; the rest works without it (host_pools needs torch).
"""
