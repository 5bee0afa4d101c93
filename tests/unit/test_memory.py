"""Shared-memory segments as the broker maps them: reservation, the shrink check, the SIGBUS guard,
and overlaps compared by file identity.

Faults happen only in child processes (a plain `python -c`): a SIGBUS in the test process would end
the suite, and pytest's own faulthandler would be in the way.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvbroker.core.errors import BrokerError, Code
from kvbroker.core.model import (
    BufferRole,
    Component,
    ComponentSpec,
    EngineSpec,
    KvDtype,
    LayerBuffer,
    Layout,
    SharedMemoryRef,
    Topology,
)
from kvbroker.flows.registry import Registry
from kvbroker.memory import mapping as memory
from kvbroker.memory.mapping import map_shared_memory, segment_identity
from kvbroker_client.shm import SharedSegment

SHM = Path("/dev/shm")
TOPO = Topology(1, 0, 1, 0, 1, 0, 0, 16, 0, 4, KvDtype.BFLOAT16)


@pytest.fixture
def segment():
    with SharedSegment.create(1 << 16, "kvbt-mem") as seg:
        yield seg


@pytest.fixture
def sparse():
    """A segment made with ftruncate only, as a careless server makes one: no page allocated."""
    path = SHM / f"kvbt-mem-sparse-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 1 << 16)
    os.close(fd)
    yield path
    path.unlink(missing_ok=True)


def child(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter, with `map_shared_memory`, `touch(address, n)` (a write from a
    thread that is not Python's, as a transfer engine's) and `shrunk(size)` (a new segment, mapped,
    then truncated to 0) at hand."""
    prelude = textwrap.dedent("""
        import ctypes, os, signal, sys, threading
        from kvbroker.memory.mapping import map_shared_memory
        from kvbroker_client.shm import SharedSegment

        def touch(address, n):
            t = threading.Thread(target=ctypes.memset, args=(address, 7, n))
            t.start()
            t.join()

        def shrunk(size):
            server = SharedSegment.create(size, "kvbt-guard")
            seg = map_shared_memory(server.name, "name")
            seg.reserve(0, size, "name")
            os.truncate("/dev/shm/" + server.name, 0)
            server.close()
            server.unlink()
            return seg
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def test_a_fault_inside_a_shrunk_segment_is_absorbed_and_poisons_it():
    result = child("""
        seg = shrunk(1 << 20)
        touch(seg.address + 3 * 4096 + 5, 100_000)  # SIGBUS at the first byte, on another thread
        print(seg.poisoned)
        try:
            seg.check_intact()
        except Exception as exc:
            print(exc.code.name, exc.reason)
        touch(seg.address, 1 << 20)  # the whole mapping is zero pages now: no fault
        seg.close()
        print("alive")
    """)
    assert result.returncode == 0, result.stderr
    poisoned, check, alive = result.stdout.splitlines()
    assert poisoned == "True" and alive == "alive"
    assert check.startswith("FAILED_PRECONDITION shared-memory segment 'kvbt-guard-")
    assert "lost its memory after registration: a transfer engine touched byte 12293 of it" in check


def test_a_fault_outside_every_segment_still_kills_the_process():
    result = child("""
        seg = shrunk(8192)  # the guard is installed and watches this one
        other = SharedSegment.create(8192, "kvbt-guard")
        view = ctypes.addressof((ctypes.c_char * 8192).from_buffer(other._mmap))
        os.truncate("/dev/shm/" + other.name, 0)
        other.unlink()
        touch(view, 10)
        print("survived")
    """)
    assert result.returncode == -signal.SIGBUS and "survived" not in result.stdout


def test_a_fault_outside_every_segment_goes_to_the_handler_installed_before():
    result = child("""
        import faulthandler
        faulthandler.enable()  # as a transfer engine's crash reporter would be, before the first registration
        seg = shrunk(8192)
        other = SharedSegment.create(8192, "kvbt-guard")
        view = ctypes.addressof((ctypes.c_char * 8192).from_buffer(other._mmap))
        os.truncate("/dev/shm/" + other.name, 0)
        other.unlink()
        touch(view, 10)
    """)
    assert result.returncode == -signal.SIGBUS
    assert "Fatal Python error: Bus error" in result.stderr


def test_a_sigbus_sent_by_kill_is_not_swallowed():
    result = child("""
        seg = shrunk(8192)
        os.kill(os.getpid(), signal.SIGBUS)
        print("survived")
    """)
    assert result.returncode == -signal.SIGBUS and "survived" not in result.stdout


def test_the_guard_takes_over_again_from_a_handler_installed_after_it():
    result = child("""
        import faulthandler
        first = shrunk(8192)
        faulthandler.enable()  # displaces the guard, as Mooncake's engine does when it starts
        seg = shrunk(8192)  # mapping a segment puts the guard first again
        touch(seg.address, 10)
        print(seg.poisoned, first.poisoned)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]


def test_check_intact_refuses_a_segment_shrunk_below_its_registered_buffers(segment):
    seg = map_shared_memory(segment.name, "name")
    try:
        seg.reserve(0, 4096, "name")
        seg.reserve(8192, 8192, "name")
        seg.check_intact()
        os.truncate(SHM / segment.name, 16384)  # the unregistered tail may go
        seg.check_intact()
        os.truncate(SHM / segment.name, 16383)
        with pytest.raises(BrokerError) as info:
            seg.check_intact()
        assert not seg.poisoned
    finally:
        seg.close()
    assert info.value.code is Code.FAILED_PRECONDITION
    assert (f"shared-memory segment {segment.name!r} was shrunk after registration: 16383 bytes now, and the "
            "registered buffers reach byte 16384") in info.value.reason


def test_check_segments_names_the_engine(segment):
    seg = map_shared_memory(segment.name, "name")
    try:
        seg.reserve(0, 1 << 16, "name")
        os.truncate(SHM / segment.name, 0)
        with pytest.raises(BrokerError) as info:
            memory.check_segments([object(), seg], "decode-0/tp0")
    finally:
        seg.close()
    assert info.value.code is Code.FAILED_PRECONDITION
    assert info.value.reason.startswith(f"engine 'decode-0/tp0': shared-memory segment {segment.name!r} was shrunk")


def test_reserve_allocates_what_the_server_did_not_and_says_so(sparse, caplog):
    seg = map_shared_memory(sparse.name, "name")
    try:
        assert os.stat(sparse).st_blocks == 0
        seg.reserve(0, 8192, "name")
        seg.reserve(8192, 8192, "name")
        assert os.stat(sparse).st_blocks * 512 == 16384
    finally:
        seg.close()
    warnings = [r for r in caplog.records if "was not allocated by its server" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"  # once per segment


def test_an_allocated_segment_is_not_walked_again(segment, caplog, monkeypatch):
    def walk(fd, offset, length):
        raise AssertionError("fallocate of a segment with every page allocated")

    seg = map_shared_memory(segment.name, "name")
    monkeypatch.setattr(memory._memguard, "reserve", walk)
    try:
        seg.reserve(0, 1 << 16, "name")
        assert seg.extent == 1 << 16
    finally:
        seg.close()
    assert not [r for r in caplog.records if "was not allocated" in r.getMessage()]


@pytest.mark.parametrize("err, code, words", [
    (errno.ENOSPC, Code.RESOURCE_EXHAUSTED, "/dev/shm cannot back 4096 bytes at offset 0 of segment"),
    (errno.ENOMEM, Code.RESOURCE_EXHAUSTED, "the broker's memory limit cannot hold 4096 bytes"),
    (errno.EIO, Code.INVALID_ARGUMENT, "cannot allocate segment"),
])
def test_a_reservation_the_kernel_refuses_names_the_field_and_the_segment(sparse, monkeypatch, err, code, words):
    def refuse(fd, offset, length):
        raise OSError(err, os.strerror(err))

    seg = map_shared_memory(sparse.name, "components[0].layer_buffers[0].memory.shared_memory")
    monkeypatch.setattr(memory._memguard, "reserve", refuse)
    try:
        with pytest.raises(BrokerError) as info:
            seg.reserve(0, 4096, "components[0].layer_buffers[0].memory.shared_memory")
    finally:
        seg.close()
    assert info.value.code is code
    assert info.value.reason.startswith("components[0].layer_buffers[0].memory.shared_memory: ")
    assert words in info.value.reason and sparse.name in info.value.reason


def test_a_filesystem_without_fallocate_is_mapped_unreserved(sparse, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "not supported")

    seg = map_shared_memory(sparse.name, "name")
    monkeypatch.setattr(memory._memguard, "reserve", unsupported)
    try:
        seg.reserve(0, 4096, "name")
        assert seg.extent == 4096
    finally:
        seg.close()


def test_close_lets_go_of_the_file_and_the_guard_slot(segment):
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        seg = map_shared_memory(segment.name, "name")
        slot = seg._slot
        seg.close()
    assert len(os.listdir("/proc/self/fd")) == fds
    again = map_shared_memory(segment.name, "name")
    again.close()
    assert again._slot == slot  # reused, not leaked


def test_a_segment_that_is_not_a_regular_file_is_refused():
    path = SHM / f"kvbt-mem-fifo-{os.getpid()}"
    os.mkfifo(path, 0o600)
    try:
        with pytest.raises(BrokerError) as info:
            map_shared_memory(path.name, "name")
    finally:
        path.unlink()
    assert info.value.code is Code.INVALID_ARGUMENT and "is not a regular file" in info.value.reason


def test_segment_identity_is_the_file_not_the_name(segment):
    link = SHM / f"{segment.name}-hard"
    symlink = SHM / f"{segment.name}-sym"
    os.link(SHM / segment.name, link)
    symlink.symlink_to(SHM / segment.name)
    try:
        assert segment_identity(link.name) == segment_identity(segment.name) is not None
        assert segment_identity(symlink.name) not in (None, segment_identity(segment.name))  # not followed
        seg = map_shared_memory(link.name, "name")
        assert seg.identity == segment_identity(segment.name)
        seg.close()
    finally:
        link.unlink()
        symlink.unlink()
    assert segment_identity("kvbt-no-such-segment") is None
    assert segment_identity("../etc/passwd") is None


def buf(layer, name, offset=0, length=1024):
    return LayerBuffer(layer, BufferRole.FLAT, SharedMemoryRef(name, offset), length, 64)


def spec(engine_id, *buffers):
    return EngineSpec(engine_id, TOPO, (ComponentSpec(Component.MINIMAX_INDEX_K, Layout.FLAT, 16, buffers),))


@pytest.fixture
def registry():
    made = Registry(1 << 20)
    yield made
    for engine in made:
        made.remove(engine.engine_id)
        engine.release()


def test_a_hard_link_to_another_engines_segment_is_an_overlap(registry, segment):
    registry.add(registry.build(spec("a", buf(2, segment.name))))
    link = SHM / f"{segment.name}-hard"
    os.link(SHM / segment.name, link)
    try:
        with pytest.raises(BrokerError) as info:
            registry.build(spec("b", buf(2, link.name, offset=512)))
        registry.add(registry.build(spec("c", buf(2, link.name, offset=1024))))  # beside it: fine
    finally:
        link.unlink()
    assert info.value.code is Code.INVALID_ARGUMENT
    assert (f"components[0].layer_buffers[0] (layer 2, FLAT).memory: overlaps components[0].layer_buffers[0] "
            f"(layer 2, FLAT) of engine 'a' in segment {link.name!r} (the same file as segment {segment.name!r}: "
            "a hard link) ([512, 1536) and [0, 1024))") == info.value.reason


def test_a_name_pointed_at_another_engines_file_after_the_check_is_refused_when_added(registry, segment):
    registry.add(registry.build(spec("a", buf(2, segment.name))))
    with SharedSegment.create(1 << 16, "kvbt-mem") as innocent:
        checked = spec("b", buf(2, innocent.name))
        registry.check(checked)  # the name is another file now
        os.link(SHM / segment.name, SHM / f"{innocent.name}-swap")
        os.rename(SHM / f"{innocent.name}-swap", SHM / innocent.name)  # and the first engine's file when mapped
        engine = registry.materialise(checked)
        try:
            with pytest.raises(BrokerError) as info:
                registry.add(engine)
        finally:
            engine.release()
    assert info.value.code is Code.INVALID_ARGUMENT and "of engine 'a'" in info.value.reason
    assert "b" not in registry


def test_a_segment_the_guard_cannot_watch_is_refused_and_left_unmapped(segment, monkeypatch):
    def full(address, length):
        raise OverflowError("at most 16384 shared-memory mappings can be watched at once")

    monkeypatch.setattr(memory._memguard, "watch", full)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(BrokerError) as info:
        map_shared_memory(segment.name, "components[0].layer_buffers[0].memory.shared_memory.name")
    assert info.value.code is Code.RESOURCE_EXHAUSTED and "at most 16384" in info.value.reason
    assert len(os.listdir("/proc/self/fd")) == fds
