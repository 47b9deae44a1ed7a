"""The TCP ports something listens on, asked of Linux's socket-diagnostics netlink (sock_diag, NETLINK_SOCK_DIAG).

The local backend asks before every readiness probe whether anyone listens on the server's port. Reading
/proc/net/tcp for that makes the kernel walk its whole table of connections, 8 ms of CPU per read on a 24 GiB
machine whatever the count; a sock_diag dump of listening sockets only walks the listeners (0.04 ms).
"""

from __future__ import annotations

import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
TCP_LISTEN = 10
HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
# inet_diag_req_v2: family, protocol, extensions, pad, states; then an all-zero inet_diag_sockid (48 bytes)
REQUEST = struct.Struct("=BBBBI48x")
SPORT_AT = HEADER.size + 4  # inet_diag_msg: family, state, timer, retrans, then the sockid's source port (big-endian)
MAX_BYTES = 16 * 2**20  # a dump is a few KiB per hundred listeners; a stream past this is not one


def _dump(family: int) -> set[int]:
    request = REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << TCP_LISTEN)
    ports: set[int] = set()
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as s:
        s.settimeout(2.0)
        s.sendall(HEADER.pack(HEADER.size + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0)
                  + request)
        received = 0
        while received < MAX_BYTES:
            data = s.recv(65536)
            if not data:
                break
            received += len(data)
            at = 0
            while at + HEADER.size <= len(data):
                length, kind = struct.unpack_from("=IH", data, at)
                if kind == NLMSG_DONE:
                    return ports
                if kind == NLMSG_ERROR or length < HEADER.size:
                    raise OSError(f"sock_diag answered message type {kind}")
                ports.add(struct.unpack_from("!H", data, at + SPORT_AT)[0])
                at += (length + 3) & ~3  # messages are 4-byte aligned
    raise OSError("sock_diag's dump did not end")


def tcp_listening_ports() -> set[int] | None:
    """Every local port a TCP socket (IPv4 or IPv6) listens on in this network namespace; None where sock_diag
    cannot be asked (not Linux, or the kernel refuses)."""
    if not hasattr(socket, "AF_NETLINK"):
        return None
    try:
        return _dump(socket.AF_INET) | _dump(socket.AF_INET6)
    except OSError:
        return None
