"""What a test process listens on, read from Linux's /proc (no psutil here)."""

from __future__ import annotations

import ipaddress
import os


def listening() -> list[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on (Linux /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                hex_ip, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_ip)
                # /proc prints the address as 32-bit words in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                out.append((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return out


def loopback(ip: str) -> bool:
    """True for a loopback address (an IPv4-mapped one included)."""
    addr = ipaddress.ip_address(ip)
    return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback
