"""The plugin on the real SGLang 0.5.23: loaded by SGLang's own load_plugins, seen by every importer."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from kvbroker_sglang import conn, plugin
from tests.support.brokers import REPO_ROOT


def test_entry_point_is_registered_in_sglangs_plugin_group():
    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvbroker"]
    assert ep.load() is plugin.load


def test_transfer_backend_kvbroker_resolves(sglang_process):
    from sglang.srt.disaggregation.utils import TransferBackend

    assert TransferBackend("kvbroker") is TransferBackend.KVBROKER
    assert TransferBackend.KVBROKER in list(TransferBackend)
    assert TransferBackend("mooncake") is TransferBackend.MOONCAKE  # the others are untouched


def test_argparse_accepts_the_kvbroker_transfer_backend(sglang_process):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--disaggregation-mode", "prefill",
                              "--disaggregation-transfer-backend", "kvbroker"])
    assert args.disaggregation_transfer_backend == "kvbroker"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--disaggregation-transfer-backend", "nonesuch"])


@pytest.mark.parametrize("module", ["sglang.srt.disaggregation.prefill", "sglang.srt.disaggregation.decode",
                                    "sglang.srt.managers.disagg_service", "sglang.srt.disaggregation.utils"])
def test_modules_that_imported_get_kv_class_return_kvbrokers_classes(sglang_process, module):
    import importlib

    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.fake.conn import FakeKVSender
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

    get_kv_class = importlib.import_module(module).get_kv_class
    backend = TransferBackend.KVBROKER
    assert get_kv_class(backend, KVClassType.MANAGER) is conn.KvbrokerKVManager
    assert get_kv_class(backend, KVClassType.SENDER) is conn.KvbrokerKVSender
    assert get_kv_class(backend, KVClassType.RECEIVER) is conn.KvbrokerKVReceiver
    assert get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER) is conn.KvbrokerKVBootstrapServer
    assert get_kv_class(backend, KVClassType.KVARGS) is KVArgs
    assert get_kv_class(TransferBackend.FAKE, KVClassType.SENDER) is FakeKVSender


def test_the_classes_are_sglangs_common_classes_the_scheduler_relies_on(sglang_process):
    from sglang.srt.disaggregation.common.conn import (
        CommonKVBootstrapServer,
        CommonKVManager,
        CommonKVReceiver,
        CommonKVSender,
    )

    assert issubclass(conn.KvbrokerKVManager, CommonKVManager)
    assert issubclass(conn.KvbrokerKVSender, CommonKVSender)
    assert issubclass(conn.KvbrokerKVReceiver, CommonKVReceiver)
    assert issubclass(conn.KvbrokerKVBootstrapServer, CommonKVBootstrapServer)
    # decode.py calls these on the manager and receiver directly (the research file's list)
    for name in ("try_ensure_parallel_info", "_ensure_prefill_recompute_executor", "poll_pp_consensus"):
        assert callable(getattr(conn.KvbrokerKVManager, name, None) or getattr(conn.KvbrokerKVSender, name))
    for name in ("query_prefill_dp_ranks", "ensure_abort_notified"):
        assert callable(getattr(conn.KvbrokerKVReceiver, name))


def test_another_sglang_version_is_refused_by_name():
    with pytest.raises(plugin.UnsupportedSGLang, match=r"tested with sglang==0\.5\.23, not 0\.5\.22"):
        plugin.check_version("0.5.22")
    plugin.check_version("0.5.23")


def test_sglang_plugins_without_kvbroker_leaves_sglang_alone():
    code = ("from kvbroker_tools.serving.cpu_torchvision import declare_torchvision_ops; declare_torchvision_ops()\n"
            "from sglang.srt.plugins import load_plugins; load_plugins()\n"
            "from sglang.srt.disaggregation.utils import TransferBackend\n"
            "print('kvbroker' in [b.value for b in TransferBackend])")
    env = {**os.environ, "SGLANG_PLUGINS": "someone-else"}
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
