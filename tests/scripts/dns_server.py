#!/usr/bin/env python3
"""A minimal authoritative DNS server over UDP for the test bed (RFC 1035 wire format).

usage: dns_server.py <answers.json> [address] [port]

answers.json maps names to {"A": [...], "AAAA": [...], "ttl": seconds}; it is read again for
every query, so a test changes the answers by rewriting the file. Unknown names get NXDOMAIN.
"""
import ipaddress
import json
import socket
import struct
import sys

TYPE_A, TYPE_AAAA = 1, 28


def question(packet):
    """The queried name (lower case, no trailing dot), type, and the question's end offset."""
    labels, at = [], 12
    while packet[at]:
        length = packet[at]
        labels.append(packet[at + 1 : at + 1 + length].decode("ascii").lower())
        at += 1 + length
    qtype, _qclass = struct.unpack("!HH", packet[at + 1 : at + 5])
    return ".".join(labels), qtype, at + 5


def answer(packet, answers):
    ident, flags = struct.unpack("!HH", packet[:4])
    name, qtype, end = question(packet)
    entry = answers.get(name)
    records = []
    if entry is not None:
        key = {TYPE_A: "A", TYPE_AAAA: "AAAA"}.get(qtype)
        for address in entry.get(key, []) if key else []:
            data = ipaddress.ip_address(address).packed
            # Name as a pointer to the question (offset 12), type, class IN, TTL, data.
            records.append(struct.pack("!HHHIH", 0xC00C, qtype, 1, entry.get("ttl", 60), len(data)) + data)
    rcode = 0 if entry is not None else 3
    # Response, authoritative, recursion desired copied, recursion available.
    reply_flags = 0x8000 | 0x0400 | (flags & 0x0100) | 0x0080 | rcode
    header = struct.pack("!HHHHHH", ident, reply_flags, 1, len(records), 0, 0)
    return header + packet[12:end] + b"".join(records)


def main():
    path = sys.argv[1]
    address = sys.argv[2] if len(sys.argv) > 2 else "0.0.0.0"
    port = int(sys.argv[3]) if len(sys.argv) > 3 else 53
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((address, port))
    while True:
        packet, client = sock.recvfrom(512)
        try:
            with open(path) as f:
                answers = json.load(f)
            sock.sendto(answer(packet, answers), client)
        except (ValueError, IndexError, OSError, struct.error) as error:
            print(f"dns_server: {error}", file=sys.stderr)


if __name__ == "__main__":
    main()
