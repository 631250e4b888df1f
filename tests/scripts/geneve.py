#!/usr/bin/env python3
"""Independent Geneve encoder/decoder for the packet tests (scapy's Geneve layer).

Reads one JSON request on stdin, prints one JSON answer on stdout:
  {"op": "encap", ...}  -> {"hex": <the encapsulated frame scapy builds>}
  {"op": "decode", "hex": ...} -> the outer and Geneve fields scapy reads
  {"op": "geneve", ...} -> {"hex": <a Geneve packet with the given header/options>}
  {"op": "l4", ...} -> {"hex": <a TCP, UDP or SCTP frame, checksums by scapy>}
  {"op": "checksums", "hex": ...} -> whether the IPv4 and TCP/UDP/SCTP checksums are right
  {"op": "icmp_about", ...} -> {"hex": <an ICMP/ICMPv6 error quoting a given IP packet>}
  {"op": "build_many", "exprs": [...]} -> {"hex": [...]}: the same for many at once
  {"op": "build", "expr": ...} -> {"hex": <the frame a scapy expression builds>} (ARP,
      neighbour discovery, MLD, DHCP: whatever a test needs scapy to encode)
"""
import json
import sys

from scapy.all import IP, UDP, Ether, IPv6, Raw
from scapy.contrib.geneve import GENEVE, GeneveOptions


def outer(req):
    from scapy.all import Dot1Q

    eth = Ether(src=req["src_mac"], dst=req["dst_mac"])
    if "vlan" in req:
        eth = eth / Dot1Q(vlan=req["vlan"])
    if ":" in req["src_ip"]:
        ip = IPv6(src=req["src_ip"], dst=req["dst_ip"], hlim=64, fl=req.get("flow_label", 0))
    else:
        ip = IP(src=req["src_ip"], dst=req["dst_ip"], ttl=64, id=0, flags="DF")
    return eth / ip


def encap(req):
    inner = bytes.fromhex(req["inner"])
    pkt = (
        outer(req)
        / UDP(sport=req["sport"], dport=req["dport"], chksum=0)
        / GENEVE(vni=req["vni"], proto=0x6558)
        / Raw(inner)
    )
    return {"hex": bytes(pkt).hex()}


def geneve(req):
    options = [
        GeneveOptions(classid=o["class"], type=o["type"], length=len(bytes.fromhex(o["data"])) // 4,
                      data=bytes.fromhex(o["data"]))
        for o in req.get("options", [])
    ]
    gen = GENEVE(
        version=req.get("version", 0),
        oam=req.get("oam", 0),
        critical=req.get("critical", 0),
        proto=req.get("proto", 0x6558),
        vni=req["vni"],
        options=options,
    )
    pkt = outer(req) / UDP(sport=req["sport"], dport=req["dport"]) / gen / Raw(bytes.fromhex(req["inner"]))
    data = bytes(pkt)
    # Claim more option bytes than the packet holds (outer lengths stay consistent, so only
    # the Geneve options field is wrong).
    extra = req.get("claim_extra_option_words", 0)
    if extra:
        at = 14 + (4 if "vlan" in req else 0) + (40 if ":" in req["src_ip"] else 20) + 8
        data = bytearray(data)
        data[at] = (data[at] & 0xC0) | min(0x3F, (data[at] & 0x3F) + extra)
        data = bytes(data)
    return {"hex": data.hex()}


def decode(req):
    pkt = Ether(bytes.fromhex(req["hex"]))
    # The outer header only: `IP in pkt` would also find an inner IPv4 header.
    ip = pkt.payload
    outer_v4 = isinstance(ip, IP)
    udp = ip[UDP]
    gen = GENEVE(bytes(udp.payload))
    answer = {
        "dst_mac": pkt.dst,
        "src_mac": pkt.src,
        "src_ip": ip.src,
        "dst_ip": ip.dst,
        "sport": udp.sport,
        "dport": udp.dport,
        "udp_len": udp.len,
        "udp_chksum": udp.chksum,
        "version": gen.version,
        "oam": gen.oam,
        "critical": gen.critical,
        "proto": gen.proto,
        "vni": gen.vni,
        "inner": bytes(gen.payload).hex(),
    }
    if outer_v4:
        answer.update(ttl=ip.ttl, df=bool(ip.flags.DF), ip_len=ip.len, ip_chksum=ip.chksum)
        # scapy recomputes the checksum of a copy with the field cleared: they must agree.
        fresh = IP(bytes(ip))
        del fresh.chksum
        answer["ip_chksum_ok"] = IP(bytes(fresh)).chksum == ip.chksum
    else:
        answer.update(hlim=ip.hlim, plen=ip.plen)
    return answer


def icmp_error(req):
    """Decodes an ICMP/ICMPv6 error frame and checks its checksums independently."""
    from scapy.all import ICMP, ICMPv6PacketTooBig, IPerror, IPerror6

    pkt = Ether(bytes.fromhex(req["hex"]))
    ip = pkt.payload
    answer = {"dst_mac": pkt.dst, "src_mac": pkt.src, "src_ip": ip.src, "dst_ip": ip.dst}
    if isinstance(ip, IP):
        icmp = pkt[ICMP]
        fresh_ip = IP(bytes(ip))
        del fresh_ip.chksum
        fresh_icmp = ICMP(bytes(icmp))
        del fresh_icmp.chksum
        answer.update(
            type=icmp.type, code=icmp.code, mtu=icmp.nexthopmtu, ttl=ip.ttl,
            ip_chksum_ok=IP(bytes(fresh_ip)).chksum == ip.chksum,
            icmp_chksum_ok=ICMP(bytes(fresh_icmp)).chksum == icmp.chksum,
            quote=bytes(icmp.payload).hex(),
        )
    else:
        from scapy.all import ICMPv6DestUnreach

        layer = ICMPv6PacketTooBig if ICMPv6PacketTooBig in pkt else ICMPv6DestUnreach
        err = pkt[layer]
        fresh = pkt.copy()
        del fresh[layer].cksum
        answer.update(
            type=err.type, code=err.code, mtu=getattr(err, "mtu", 0), hlim=ip.hlim,
            icmp_chksum_ok=Ether(bytes(fresh))[layer].cksum == err.cksum,
            quote=bytes(err.payload).hex(),
        )
    return answer


def sctp(req, payload):
    """An SCTP packet with one chunk: INIT, ABORT or DATA carrying the payload. Its CRC32c is
    scapy's, or zero with "zero_checksum" (left to offload, as a sender over veth does)."""
    from scapy.layers.sctp import SCTP, SCTPChunkAbort, SCTPChunkData, SCTPChunkInit

    chunk = {
        "INIT": lambda: SCTPChunkInit(init_tag=0x1234ABCD, a_rwnd=65536, n_out_streams=10,
                                      n_in_streams=10, init_tsn=1),
        "ABORT": lambda: SCTPChunkAbort(),
    }.get(req.get("flags", ""), lambda: SCTPChunkData(tsn=7, stream_id=0, proto_id=0, data=payload))()
    header = SCTP(sport=req["sport"], dport=req["dport"], tag=req.get("tag", 0x1234ABCD))
    if req.get("zero_checksum"):
        header.chksum = 0
    return header / chunk


def l4(req):
    """A TCP, UDP or SCTP frame with every checksum computed by scapy (IPv4 or IPv6), but
    the UDP checksum set to `udp_chksum` when given (0: sent without one)."""
    from scapy.all import TCP

    eth = Ether(src=req.get("src_mac", "0a:58:0a:f4:01:09"), dst=req.get("dst_mac", "02:00:00:00:01:09"))
    if ":" in req["src"]:
        ip = IPv6(src=req["src"], dst=req["dst"], hlim=64)
    else:
        ip = IP(src=req["src"], dst=req["dst"], ttl=64, id=req.get("ip_id", 1), flags="DF")
    if req["proto"] == "tcp":
        l4 = TCP(sport=req["sport"], dport=req["dport"], flags=req.get("flags", "S"),
                 seq=req.get("seq", 1000), ack=req.get("ack", 0), window=req.get("window", 64240))
    elif req["proto"] == "sctp":
        payload = bytes.fromhex(req.get("payload", "68656c6c6f"))
        return {"hex": bytes(eth / ip / sctp(req, payload)).hex()}
    else:
        l4 = UDP(sport=req["sport"], dport=req["dport"])
        if "udp_chksum" in req:
            l4.chksum = req["udp_chksum"]
    payload = bytes.fromhex(req.get("payload", "68656c6c6f"))
    pkt = eth / ip / l4
    if payload:
        pkt = pkt / Raw(payload)
    return {"hex": bytes(pkt).hex()}


def checksums(req):
    """Whether the IPv4 header and TCP/UDP/SCTP checksums of a frame are right, recomputed by
    scapy (SCTP's is CRC32c over the SCTP packet)."""
    from scapy.all import TCP
    from scapy.layers.sctp import SCTP

    pkt = Ether(bytes.fromhex(req["hex"]))
    fresh = pkt.copy()
    answer = {}
    if IP in pkt:
        del fresh[IP].chksum
    l4 = TCP if TCP in pkt else SCTP if SCTP in pkt else UDP
    del fresh[l4].chksum
    rebuilt = Ether(bytes(fresh))
    if IP in pkt:
        answer["ip_chksum_ok"] = rebuilt[IP].chksum == pkt[IP].chksum
    answer["l4_chksum_ok"] = rebuilt[l4].chksum == pkt[l4].chksum
    return answer


def icmp_about(req):
    """An ICMP (or ICMPv6) error from `src` to `dst` of `type`/`code` quoting the IP packet
    `quote` (hex), every checksum computed by scapy."""
    from scapy.all import ICMP, ICMPv6DestUnreach, ICMPv6PacketTooBig, ICMPv6TimeExceeded

    eth = Ether(src=req.get("src_mac", "0a:58:0a:f4:01:03"), dst=req.get("dst_mac", "02:00:00:00:01:03"))
    quote = Raw(bytes.fromhex(req["quote"]))
    if ":" in req["src"]:
        layer = {1: ICMPv6DestUnreach, 2: ICMPv6PacketTooBig, 3: ICMPv6TimeExceeded}[req["type"]]
        error = layer(code=req["code"])
        pkt = eth / IPv6(src=req["src"], dst=req["dst"], hlim=64) / error / quote
    else:
        pkt = eth / IP(src=req["src"], dst=req["dst"], ttl=64, id=7) / ICMP(type=req["type"], code=req["code"]) / quote
    return {"hex": bytes(pkt).hex()}


def build(req):
    """The bytes of a scapy expression, e.g. `Ether(...)/ARP(op=2, psrc=...)`."""
    import scapy.all as scapy_all
    import scapy.contrib.geneve as geneve_layer

    names = dict(vars(scapy_all), GENEVE=geneve_layer.GENEVE)
    return {"hex": bytes(eval(req["expr"], names)).hex()}


def build_many(req):
    """The bytes of each of a list of scapy expressions, in one run of the interpreter."""
    return {"hex": [build({"expr": expr})["hex"] for expr in req["exprs"]]}


def main():
    req = json.load(sys.stdin)
    handler = {
        "encap": encap, "decode": decode, "geneve": geneve, "icmp_error": icmp_error,
        "l4": l4, "checksums": checksums, "icmp_about": icmp_about, "build": build,
        "build_many": build_many,
    }[req["op"]]
    json.dump(handler(req), sys.stdout)


if __name__ == "__main__":
    main()
