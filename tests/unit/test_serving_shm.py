"""A server killed or stopped leaves no /dev/shm behind: `ServerProcess.kill` and `stop` unlink the
segments its process group held (a vLLM server's KV cache moved into /dev/shm is a GiB; a suite's
worth of killed servers once filled a 24 GiB machine)."""

from __future__ import annotations

import asyncio
import secrets
import sys
from pathlib import Path

import pytest

from kvbroker_tools.serving.stack import ServerProcess

# A leader that maps one segment and starts a child in its group that maps another and holds a third
# open without mapping it; each prints its names and sleeps (SIGTERM ignored: stop must SIGKILL it).
FAMILY = """
import mmap, os, signal, subprocess, sys, time
def segment(name, map_it=True):
    fd = os.open('/dev/shm/' + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 4096)
    if map_it:
        m = mmap.mmap(fd, 4096)
        os.close(fd)
        return m
    return fd
signal.signal(signal.SIGTERM, signal.SIG_IGN)
tag = sys.argv[1]
if sys.argv[2] == 'leader':
    held = segment(tag + '-leader')
    child = subprocess.Popen([sys.executable, '-c', sys.argv[3], tag, 'child'], stdout=subprocess.PIPE)
    print(child.stdout.readline().decode().strip(), flush=True)
else:
    held = (segment(tag + '-child'), segment(tag + '-open', map_it=False))
    print('ready', flush=True)
time.sleep(120)
"""


def existing(paths: list[Path]) -> list[Path]:
    return [path for path in paths if path.exists()]


async def family(tmp_path: Path, tag: str) -> ServerProcess:
    process = await asyncio.create_subprocess_exec(sys.executable, "-c", FAMILY, tag, "leader", FAMILY,
                                                   stdout=asyncio.subprocess.PIPE, start_new_session=True)
    assert await asyncio.wait_for(process.stdout.readline(), 30) == b"ready\n"
    return ServerProcess("family", process, "http://127.0.0.1:1", tmp_path / "family.log", [], {})


@pytest.mark.parametrize("end", ["kill", "stop"])
async def test_a_server_ended_leaves_none_of_its_group_segments(tmp_path, end):
    tag = f"kvbroker-test-{secrets.token_hex(4)}"
    names = [Path(f"/dev/shm/{tag}-{n}") for n in ("leader", "child", "open")]
    bystander = Path(f"/dev/shm/{tag}-bystander")  # someone else's segment, not the group's
    bystander.touch()  # noqa: ASYNC240  a tmpfs file, at once
    try:
        server = await family(tmp_path, tag)
        assert existing(names) == names
        if end == "kill":
            await server.kill()
        else:
            await server.stop(timeout=0.5)
        assert existing(names) == []
        assert existing([bystander]) == [bystander]
    finally:
        for name in (*names, bystander):
            name.unlink(missing_ok=True)
