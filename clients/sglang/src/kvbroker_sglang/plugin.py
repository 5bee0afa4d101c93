"""The SGLang plugin: `--disaggregation-transfer-backend kvbroker` on an unmodified SGLang 0.5.23.

SGLang loads entry points of group `sglang.srt.plugins` (allow-listed by SGLANG_PLUGINS) in the
launcher before it parses arguments and again in every scheduler child; `load()` is ours. It

    adds "kvbroker" to DISAGG_TRANSFER_BACKEND_CHOICES (argparse) and KVBROKER to TransferBackend
    wraps get_kv_class, through SGLang's HookRegistry, so that every module that imported the name
        (prefill.py, decode.py, disagg_service, the scheduler) returns kvbroker_sglang.conn's classes
    records each pool's layer ids on its KVArgs (an AFTER hook on setup_state_kv_args): KVArgs
        carries bare pointers, and kv_layer_ids is empty for MiniMax's pool
    builds host (CPU) KV pools in shared memory (an AROUND hook on the KV-cache configurator's
        _build_token_to_kv_pool, see host_pools), so brokers can open them; GPU pools stay as they are

It refuses any SGLang but the one it is tested with, saying so (SGLang logs a failing plugin and
goes on; the kvbroker choice is then absent and argparse names it invalid).
"""

from __future__ import annotations

import enum
import importlib.metadata
import logging

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
BACKEND = "kvbroker"
_UTILS = "sglang.srt.disaggregation.utils"


class UnsupportedSGLang(RuntimeError):
    """The installed SGLang is not the release this plugin is tested with."""


def check_version(installed: str | None = None) -> None:
    if installed is None:
        try:
            installed = importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            raise UnsupportedSGLang("kvbroker's SGLang plugin needs sglang installed") from None
    if installed != SGLANG_VERSION:
        raise UnsupportedSGLang(f"kvbroker-sglang is tested with sglang=={SGLANG_VERSION}, not {installed}: install "
                                f"sglang=={SGLANG_VERSION}, or a kvbroker-sglang made for {installed}")


def extend_enum(cls: type[enum.Enum], name: str, value: str) -> enum.Enum:
    """Add a member to an existing Enum in place, so members already handed out stay the same objects."""
    if name in cls.__members__:
        return cls[name]
    member = object.__new__(cls)
    member._name_, member._value_ = name, value
    member.__objclass__ = cls  # type: ignore[attr-defined]  # a member's private fields, as EnumType sets them
    member._sort_order_ = len(cls._member_names_)  # type: ignore[attr-defined]
    type.__setattr__(cls, name, member)
    cls._member_names_.append(name)
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    return member


def _get_kv_class(original, transfer_backend, class_type):
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

    if transfer_backend is not getattr(TransferBackend, "KVBROKER", None) or class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    from kvbroker_sglang import conn

    return {
        KVClassType.MANAGER: conn.KvbrokerKVManager,
        KVClassType.SENDER: conn.KvbrokerKVSender,
        KVClassType.RECEIVER: conn.KvbrokerKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.KvbrokerKVBootstrapServer,
    }.get(class_type)


def _record_pool(result, kv_args, token_to_kv_pool, *args, **kwargs):
    from kvbroker_sglang.layout import PoolLayers

    kv_args.kvbroker_pool = PoolLayers.of(token_to_kv_pool)
    return result


def load() -> None:
    """The entry point SGLang's load_plugins() calls; SGLang applies the hooks right after."""
    check_version()
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from kvbroker_sglang import host_pools

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        DISAGG_TRANSFER_BACKEND_CHOICES.append(BACKEND)
    extend_enum(TransferBackend, "KVBROKER", BACKEND)
    HookRegistry.register(f"{_UTILS}.get_kv_class", _get_kv_class, HookType.AROUND)
    HookRegistry.register(f"{_UTILS}.setup_state_kv_args", _record_pool, HookType.AFTER)
    HookRegistry.register(host_pools.HOOK_TARGET, host_pools.build_pool_in_shared_memory, HookType.AROUND)
    log.info("kvbroker: transfer backend %r registered with SGLang %s", BACKEND, SGLANG_VERSION)
