"""benchmarks/gpu_check.py without a GPU: its arguments, shape, page lists, requests and figures."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvbroker.core.model import BrokerAllocation, Component, Layout
from kvbroker.core.model import CudaIpcRef as BrokerCudaIpcRef
from kvbroker.edge import convert
from kvbroker.memory.mapping import POOL_ALIGNMENT
from kvbroker_client.model import CudaIpcRef
from kvbroker_client.v1 import broker_service_pb2 as bpb
from kvbroker_tools import shapes

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # dataclasses look their module up there
_spec.loader.exec_module(gpu_check)


def test_defaults_run_both_ownerships_over_nixl_within_five_minutes():
    check = gpu_check.parse_args([])
    assert (check.backend, check.size_mib, check.repeats, check.ownerships) == ("nixl", 256, 5, ("server", "broker"))
    assert check.deadline_s < 300 and check.src_device is None and check.dst_device is None


def test_arguments_choose_one_ownership_and_the_devices():
    check = gpu_check.parse_args(["--ownership", "broker", "--backend", "mooncake", "--src-device", "1",
                                  "--dst-device", "0", "--size-mib", "8", "--out", "/tmp/r.json"])
    assert (check.ownerships, check.backend, check.src_device, check.dst_device, check.size_mib, check.out) == (
        ("broker",), "mooncake", 1, 0, 8, Path("/tmp/r.json"))


def test_nonpositive_sizes_are_refused():
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--size-mib", "0"])


@pytest.mark.parametrize("size_mib", [1, 64, 256, 1024])
def test_the_shape_holds_the_request_twice_over(size_mib):
    shape = gpu_check.check_shape(size_mib)
    assert shape.request_bytes() >= size_mib << 20
    assert shape.request_bytes(shape.request_pages - 1) < max(size_mib << 20, 1)
    assert shape.num_pages >= 2 * shape.request_pages and shape.num_pages % gpu_check.MAX_RUN == 0
    assert (shape.dense_layers, shape.sparse_layers, shape.kv_item_len, shape.index_item_len) == (4, 60, 4096, 2048)


def test_page_lists_are_distinct_fragmented_and_reproducible():
    shape = gpu_check.check_shape(64)
    src, dst = gpu_check.page_lists(shape, seed=3)
    assert src.size == dst.size == shape.request_pages
    assert np.unique(src).size == src.size and np.unique(dst).size == dst.size
    assert src.max() < shape.num_pages and dst.max() < shape.num_pages
    again = gpu_check.page_lists(shape, seed=3)
    assert (again[0] == src).all() and (again[1] == dst).all()
    assert np.count_nonzero(np.diff(src) != 1) > 0  # more than one run


def test_broker_pool_placements_follow_the_registration_order_aligned():
    shape = gpu_check.check_shape(4)
    placements, size = gpu_check.broker_pool_placements(shape)
    assert [(p.component, p.layer_id, p.role) for p in placements] == [
        (p.component, p.layer_id, p.role) for p in shapes.place_buffers(shape)]
    assert all(p.offset % POOL_ALIGNMENT == 0 for p in placements)
    assert size >= placements[-1].offset + shape.num_pages * placements[-1].item_len


def test_server_owned_request_names_each_buffer_by_its_cuda_ref():
    shape = gpu_check.check_shape(1)
    placements = shapes.place_buffers(shape)
    refs = [CudaIpcRef(bytes(range(1, 65)), 0, p.offset, shapes.pool_size(shape, placements)) for p in placements]
    request = gpu_check.register_request("prefill/tp0", shape, placements, refs, device=0)
    spec = convert.engine_spec_in(bpb.RegisterEngineRequest.FromString(request.SerializeToString()))
    assert spec.broker_allocation is None
    assert [c.kind for c in spec.components] == [Component.MAIN_KV, Component.MINIMAX_INDEX_K]
    assert spec.components[0].layout is Layout.KV_SPLIT and len(spec.components[1].layer_buffers) == 60
    first = spec.components[0].layer_buffers[0]
    assert first.memory == BrokerCudaIpcRef(bytes(range(1, 65)), 0, 0, shapes.pool_size(shape, placements))


def test_broker_owned_request_leaves_memory_unset_and_names_the_device():
    shape = gpu_check.check_shape(1)
    request = gpu_check.register_request("decode/tp0", shape, shapes.place_buffers(shape), None, device=1)
    spec = convert.engine_spec_in(request)
    assert spec.broker_allocation == BrokerAllocation(1)
    assert all(b.memory is None for c in spec.components for b in c.layer_buffers)


def test_figures_are_the_median_in_gb_per_s_and_ratios_compare_stages():
    out = gpu_check.figures(2_000_000_000, [2.0, 1.0, 4.0])
    assert (out["median_s"], out["gb_per_s"]) == (2.0, 1.0)
    stages = {"broker_server_owned": {"gb_per_s": 40.0}, "broker_broker_owned": {"ok": False},
              "direct": {"gb_per_s": 50.0}, "device_copy": {"gb_per_s": 200.0}}
    assert gpu_check.ratios(stages) == {"broker_server_owned/device_copy": 0.2, "broker_server_owned/direct": 0.8,
                                        "direct/device_copy": 0.25}


def test_mismatches_point_at_the_first_differing_byte():
    a = np.zeros(10, dtype=np.uint8)
    b = a.copy()
    b[[3, 7]] = 1
    assert gpu_check.mismatches(a, b) == {"mismatched_bytes": 2, "first_mismatch_at": 3}
    assert gpu_check.mismatches(a, a) == {"mismatched_bytes": 0, "first_mismatch_at": None}


def test_help_works_without_a_gpu():
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--ownership" in result.stdout and "GPU check" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what the script says on a machine without a GPU")
def test_without_a_gpu_it_says_so_and_exits_2():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert json.loads(result.stdout) == {"check": "gpu", "ok": False,
                                         "error": "no CUDA device: this check needs an NVIDIA GPU"}
