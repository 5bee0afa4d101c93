"""KvbrokerKVBootstrapServer: SGLang's bootstrap server, whose /route rows also name each prefill rank's
broker and engine."""

from __future__ import annotations

import json

from aiohttp import web
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

from kvbroker_sglang.sglang_0_5_23 import BootstrapSurface


class KvbrokerKVBootstrapServer(BootstrapSurface, CommonKVBootstrapServer):
    def __init__(self, host: str, port: int):
        self.kvbroker_ranks: dict[tuple[int, int, int, int], dict] = {}
        super().__init__(host, port)

    async def route_put(self, data: dict, response):
        entry = data.get("kvbroker")
        if response.status == 200 and isinstance(entry, dict):
            dp_group = data["attn_dp_rank"] if data["system_dp_size"] == 1 else data["system_dp_rank"]
            key = (int(dp_group), int(data["attn_cp_rank"]), int(data["attn_tp_rank"]), int(data["pp_rank"]))
            async with self.lock:
                self.kvbroker_ranks[key] = {"kvbroker_address": str(entry.get("broker_address", "")),
                                            "kvbroker_engine_id": str(entry.get("engine_id", ""))}
        return response

    async def route_get(self, request: web.Request, response):
        query = request.query
        try:
            key = (int(query["prefill_dp_rank"]), int(query["prefill_cp_rank"]), int(query["target_tp_rank"]),
                   int(query["target_pp_rank"]))
        except (KeyError, ValueError):
            return response
        if response.status != 200 or key[0] == -1:
            return response
        async with self.lock:
            entry = self.kvbroker_ranks.get(key)
        if entry is None:
            return response
        return web.json_response({**json.loads(response.body), **entry}, status=200)

    def close(self) -> None:
        """SGLang's close, after ending the server's own cleanup task (upstream leaves it pending)."""
        self.cancel_background_tasks()
        super().close()
