"""Which transports check a peer's remote region against registered memory, and which write wherever
they are told: what `allow_unprotected_transports` decides about (README.md, Security).

Measured (benchmarks/forged_region.py; NIXL 1.5.1 with UCX 1.23.0, mooncake-transfer-engine
0.3.13.post1): a peer whose NIXL metadata names a region its broker never registered (the real
metadata with one region's address and length rewritten, its remote key kept) writes and reads
there through UCX's tcp transport and through UCX's default transports on one host (shared memory),
and a write to 0x1000 over tcp kills the receiving broker (SIGSEGV). UCX's software emulation of
RMA, which every transport without hardware RMA uses (tcp, the shared-memory ones, ud), writes at
the address the packet names; cma writes into the peer process with process_vm_writev. Mooncake's
tcp transport refuses both ("WRITE rejected by server"): its server checks the address against the
memory registered with it, as an RDMA NIC checks a memory key.

So for NIXL only RDMA transports with hardware memory keys (rc, dc, and ud beside them, which UCX
uses to wire them up) and GPU IPC (cuda_ipc, with cuda_copy and gdr_copy) are protected, and only
when the operator names them in UCX_TLS: left unset, UCX picks tcp and shared memory wherever it
finds no RDMA device. Mooncake is protected over tcp and RDMA alike.
"""

from __future__ import annotations

# UCX_TLS entries (transports and aliases) whose remote accesses a hardware memory key bounds.
UCX_PROTECTED = frozenset({
    "rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5", "ib",
    "cuda_ipc", "cuda_copy", "gdr_copy", "cuda", "rocm_ipc", "rocm_copy", "rocm_gdr", "rocm", "self",
})
UCX_WIREUP = frozenset({"ud", "ud_v", "ud_x", "ud_verbs", "ud_mlx5"})  # AM only: protected beside rc or dc
UCX_RDMA = frozenset({"rc", "rc_v", "rc_x", "rc_verbs", "rc_mlx5", "dc", "dc_x", "dc_mlx5", "ib"})


def unprotected(backend: str, ucx_tls: str | None) -> str:
    """Why the engine's transports may write outside registered memory for a forged remote region;
    "" when they cannot. `ucx_tls`: the UCX_TLS variable the NIXL agent will read (None: unset)."""
    if backend != "nixl":
        return ""
    value = (ucx_tls or "").strip()
    if not value:
        return ("UCX_TLS is unset, so UCX picks among all its transports: tcp and shared memory (posix, "
                "sysv, cma) wherever it finds no RDMA device")
    if value.startswith("^") or "all" in value.split(","):
        return f"UCX_TLS={value} leaves UCX free to pick tcp and shared memory (posix, sysv, cma)"
    names = [n.strip().lower().removeprefix("\\") for n in value.split(",") if n.strip()]
    open_ones = [n for n in names if n not in UCX_PROTECTED and n not in UCX_WIREUP]
    if not any(n in UCX_RDMA for n in names):
        open_ones += [n for n in names if n in UCX_WIREUP]  # ud alone emulates RMA in software
    if open_ones:
        return (f"UCX_TLS={value} names {', '.join(open_ones)}, which write and read at whatever address a "
                "peer's remote region names")
    return ""
