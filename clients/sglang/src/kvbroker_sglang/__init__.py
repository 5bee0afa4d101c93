"""kvbroker for SGLang's PD disaggregation: an adapter on kvbroker_client.adapter (the engine-neutral core).

    plugin         the `sglang.srt.plugins` entry point: `--disaggregation-transfer-backend kvbroker`
    conn           the classes SGLang 0.5.23 runs: manager (both roles' base and the factory),
                   prefill (the prefill manager and KvbrokerKVSender), decode (the decode manager and
                   KvbrokerKVReceiver), bootstrap (the bootstrap server), aux_only (no pages, the aux row)
    layout         KVArgs -> components and topology: the tables
    host_pools     SGLang's CPU KV pools built in /dev/shm (the plugin's hook on SGLang's pool construction)
    wire           the ZMQ frames decode sends prefill
    sglang_0_5_23  every use of SGLang's private surface, read from that release

Only the role modules, sglang_0_5_23 and `plugin.load` import SGLang; layout and wire work without it.
"""
