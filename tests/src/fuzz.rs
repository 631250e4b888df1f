//! Hostile input at scale (`cargo xtask fuzz`): random and mutated frames through every entry
//! program with BPF_PROG_TEST_RUN, against maps filled as on a real node (the overlay of three
//! nodes, local pods with port security, Services with and without endpoints, affinity,
//! NodePort and SCTP, a NetworkPolicy and an EgressFirewall). The tail-called stages run from
//! their entry programs, as packets reach them.
//!
//! Each result is checked against invariants: the run succeeds; the verdict is one the program
//! may return (never XDP_ABORTED); no output frame is larger than its input plus one
//! encapsulation; no frame `tc_from_pod` lets go has a source the pod does not own; and the
//! counters add up (every frame counted once at its hook, every drop verdict counted as a drop
//! with exactly one reason).
//!
//! Seed frames are built by scapy (independent of our parser) and then mutated: bytes set,
//! bits flipped, 16-bit fields set to their edges, frames cut or extended; one frame in ten is
//! random bytes.

use std::{collections::BTreeMap, net::IpAddr};

use anyhow::{Context as _, bail, ensure};
use dataplane_common::{
    Hook, PacketClass,
    lb::{NODEPORT_ANY_V4, SCOPE_CLUSTER, SCOPE_NODEPORT, ServiceKey},
    maps::{PROG_FROM_POD, PROG_TO_POD, PROG_UNDERLAY, PROG_UNDERLAY_TC},
};
use dataplane_user::{
    acl::{
        AclPod, AclState, DesiredFirewalls,
        firewall::{DnsAddresses, FirewallContext, compile_firewalls},
        pods::{PolicyPod, PolicyPods},
        policy::policy_sets,
        select::PolicyCluster,
    },
    api::egressfirewall::EgressFirewall,
    lb::{AddressKind, BackendAddr, LbState, ServicePort},
    mapsync::addr16,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;

use crate::{
    overlay_bed::{self, Bed},
    packets::{POD_MAC, SRC_V4, SRC_V6},
    scapy,
};

/// The most an output frame may grow: one Geneve encapsulation over IPv6 (outer Ethernet,
/// IPv6, UDP, Geneve), which is also more than any answer the programs build adds.
pub const MAX_GROWTH: usize = 14 + 40 + 8 + 8;
/// Frames are kept within what a test run takes and a link carries.
const MAX_FRAME: usize = 1514;
const MIN_FRAME: usize = 15;

const XDP_ABORTED: u32 = 0;
const XDP_DROP: u32 = 1;
const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

/// What one program did with its frames.
#[derive(Debug, Default)]
pub struct ProgramReport {
    pub program: &'static str,
    pub frames: u64,
    /// Verdict name -> frames.
    pub verdicts: BTreeMap<&'static str, u64>,
    /// Drop reason -> frames, from the counters.
    pub drops: BTreeMap<&'static str, u64>,
    /// Frames the seed mutations left well-formed enough to pass or be forwarded.
    pub forwarded: u64,
}

/// The four entry programs, the hook they count at, and whether they are XDP.
const PROGRAMS: [(&str, Hook, bool); 4] = [
    (PROG_UNDERLAY, Hook::Underlay, true),
    (PROG_UNDERLAY_TC, Hook::UnderlayTc, false),
    (PROG_FROM_POD, Hook::FromPod, false),
    (PROG_TO_POD, Hook::ToPod, false),
];

/// Runs `frames` fuzzed frames through each entry program, seeded with `seed`; fails at the
/// first broken invariant, naming the program and the frame.
pub fn run(frames: u64, seed: u64) -> anyhow::Result<Vec<ProgramReport>> {
    let mut reports = Vec::new();
    for (index, &(program, hook, xdp)) in PROGRAMS.iter().enumerate() {
        // A fresh node per program: its counters are then exactly this program's.
        let mut bed = cluster()?;
        let seeds = seeds_for(program)?;
        let mut rng = XorShift::new(seed ^ (index as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut report = ProgramReport {
            program,
            ..ProgramReport::default()
        };
        let mut dropped = 0u64;
        for n in 0..frames {
            let mut frame = mutated(&seeds, &mut rng);
            if !xdp {
                as_the_skb_test_run_takes(&mut frame, &mut rng);
            }
            let outcome = if xdp {
                bed.fixture.run_xdp(program, &frame, 1)
            } else {
                bed.fixture.run_tc(program, &frame, 1)
            }
            .with_context(|| format!("{program}: frame {n} {}", scapy::hex(&frame)))?;
            let verdict = verdict_name(xdp, outcome.action)
                .with_context(|| format!("{program}: frame {n} {}", scapy::hex(&frame)))?;
            *report.verdicts.entry(verdict).or_default() += 1;
            let drop = if xdp {
                outcome.action == XDP_DROP
            } else {
                outcome.action == TC_ACT_SHOT
            };
            if drop {
                dropped += 1;
                continue;
            }
            report.forwarded += 1;
            ensure!(
                outcome.output.len() <= frame.len() + MAX_GROWTH,
                "{program}: frame {n} grew from {} to {} bytes: {}",
                frame.len(),
                outcome.output.len(),
                scapy::hex(&frame)
            );
            if program == PROG_FROM_POD {
                sent_as_the_pod(&frame)
                    .with_context(|| format!("{program}: frame {n} {}", scapy::hex(&frame)))?;
            }
        }
        report.frames = frames;
        let counters = bed.fixture.counters();
        let total = counters.packets(hook, PacketClass::Total);
        ensure!(
            total == frames,
            "{program}: {frames} frames run, {total} counted"
        );
        let counted_drops = counters.packets(hook, PacketClass::Dropped);
        ensure!(
            counted_drops == dropped,
            "{program}: {dropped} drop verdicts, {counted_drops} counted as dropped"
        );
        let reasons: u64 = counters.drops.iter().map(|d| d.count).sum();
        ensure!(
            reasons == dropped,
            "{program}: {dropped} drop verdicts, {reasons} drop reasons counted"
        );
        report.drops = counters.drops.iter().map(|d| (d.reason, d.count)).collect();
        reports.push(report);
    }
    Ok(reports)
}

/// The verdict's name, or an error for one the program may not return.
fn verdict_name(xdp: bool, action: u32) -> anyhow::Result<&'static str> {
    Ok(match (xdp, action) {
        (true, XDP_ABORTED) => bail!("XDP_ABORTED"),
        (true, XDP_DROP) => "drop",
        (true, 2) => "pass",
        (true, 3) => "tx",
        (true, 4) => "redirect",
        (false, TC_ACT_OK) => "ok",
        (false, TC_ACT_SHOT) => "shot",
        (false, TC_ACT_REDIRECT) => "redirect",
        (_, other) => bail!("verdict {other} is not one the program returns"),
    })
}

/// Checks that a frame `tc_from_pod` did not drop was sent as the pod: its MAC, and for IP
/// its own address (or what a pod sends before it has one: DHCP from 0.0.0.0, IPv6 from `::`
/// or its link-local address), for ARP its own MAC and address as the sender.
fn sent_as_the_pod(frame: &[u8]) -> anyhow::Result<()> {
    ensure!(frame[6..12] == POD_MAC, "let go with another source MAC");
    let ether_type = u16::from_be_bytes([frame[12], frame[13]]);
    match ether_type {
        0x0800 => {
            let source: [u8; 4] = frame
                .get(26..30)
                .context("IPv4 without a source")?
                .try_into()?;
            let dhcp = source == [0; 4] && frame.get(23) == Some(&17);
            ensure!(
                source == SRC_V4 || dhcp,
                "let go from {}",
                IpAddr::from(source)
            );
        }
        0x86DD => {
            let source: [u8; 16] = frame
                .get(22..38)
                .context("IPv6 without a source")?
                .try_into()?;
            let link_local = source[..8] == [0xfe, 0x80, 0, 0, 0, 0, 0, 0];
            ensure!(
                source == SRC_V6 || source == [0; 16] || link_local,
                "let go from {}",
                IpAddr::from(source)
            );
            if link_local {
                let mac = dataplane_common::port::link_local_of(POD_MAC);
                ensure!(source == mac, "let go from another link-local address");
            }
        }
        0x0806 => {
            ensure!(
                frame.get(22..28) == Some(&POD_MAC[..]),
                "ARP for another MAC"
            );
            ensure!(
                frame.get(28..32) == Some(&SRC_V4[..]) || frame.get(28..32) == Some(&[0u8; 4][..]),
                "ARP for another address"
            );
        }
        other => bail!("let go with EtherType {other:#06x}"),
    }
    Ok(())
}

/// A frame for the next run: one of `seeds` mutated, or (one in ten) random bytes.
fn mutated(seeds: &[Vec<u8>], rng: &mut XorShift) -> Vec<u8> {
    if rng.below(10) == 0 {
        let len = MIN_FRAME + rng.below(300) as usize;
        return (0..len).map(|_| rng.next_u64() as u8).collect();
    }
    let mut frame = seeds[rng.below(seeds.len() as u64) as usize].clone();
    for _ in 0..1 + rng.below(4) {
        mutate(&mut frame, rng);
    }
    frame.truncate(MAX_FRAME);
    // The kernel's test run refuses a frame of an Ethernet header alone for tc programs
    // (nothing after it): one byte more at least.
    frame.resize(frame.len().max(MIN_FRAME), 0);
    frame
}

/// The kernel's test run for tc programs refuses an IPv4 frame (by its EtherType) shorter than
/// an IPv4 header, or an IPv6 one shorter than an IPv6 header, before any program runs: such
/// frames are lengthened with random bytes. (The parser's handling of the short ones is
/// fuzzed through XDP, which runs the same parser on any length.)
fn as_the_skb_test_run_takes(frame: &mut Vec<u8>, rng: &mut XorShift) {
    let least = match u16::from_be_bytes([frame[12], frame[13]]) {
        0x0800 => 14 + 20,
        0x86DD => 14 + 40,
        _ => return,
    };
    while frame.len() < least {
        frame.push(rng.next_u64() as u8);
    }
}

/// One mutation of `frame`, mostly within its headers (the first 100 bytes).
fn mutate(frame: &mut Vec<u8>, rng: &mut XorShift) {
    let span = frame.len().clamp(1, 100) as u64;
    let at = |rng: &mut XorShift, len: usize| {
        if rng.below(4) == 0 {
            rng.below(len.max(1) as u64) as usize
        } else {
            rng.below(span) as usize
        }
    };
    match rng.below(6) {
        0 => {
            let i = at(rng, frame.len());
            frame[i] = rng.next_u64() as u8;
        }
        1 => {
            let i = at(rng, frame.len());
            frame[i] ^= 1 << rng.below(8);
        }
        2 => {
            // A 16-bit field (a length, a port, a type) at one of its edges.
            let i = at(rng, frame.len().saturating_sub(1));
            let edge: u16 = match rng.below(5) {
                0 => 0,
                1 => 0xffff,
                2 => 1,
                3 => frame.len() as u16,
                _ => 0x8000,
            };
            if i + 1 < frame.len() {
                frame[i..i + 2].copy_from_slice(&edge.to_be_bytes());
            }
        }
        3 => {
            let len =
                MIN_FRAME + rng.below(frame.len().saturating_sub(MIN_FRAME).max(1) as u64) as usize;
            frame.truncate(len);
        }
        4 => {
            let more = 1 + rng.below(64) as usize;
            frame.extend((0..more).map(|_| rng.next_u64() as u8));
        }
        _ => {
            // A chunk repeated (an extension header or option twice, say).
            let start = at(rng, frame.len());
            let len = (1 + rng.below(16) as usize).min(frame.len() - start);
            let chunk = frame[start..start + len].to_vec();
            let into = at(rng, frame.len());
            frame.splice(into..into, chunk);
        }
    }
}

/// A small deterministic generator: the same seed gives the same frames.
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// A node as the agent fills it: the overlay bed (this node `a` with a local pod and the
/// test pod, nodes `b` and `c`, a hybrid node on VXLAN), Services, a NetworkPolicy and an
/// EgressFirewall.
fn cluster() -> anyhow::Result<Bed> {
    let mut bed = overlay_bed::bed()?;
    let fixture = &mut bed.fixture;
    let backend = |text: &str| -> BackendAddr {
        let (address, port) = text.rsplit_once(':').expect("addr:port");
        BackendAddr {
            ip: address.trim_matches(['[', ']']).parse().expect("address"),
            port: port.parse().expect("port"),
        }
    };
    let service = |vip: &str, port: u16, protocol: u8, scope: u8, backends: &[&str], affinity| {
        let mut ready: Vec<BackendAddr> = backends.iter().map(|b| backend(b)).collect();
        ready.sort();
        let addr = if vip.is_empty() {
            NODEPORT_ANY_V4
        } else {
            addr16(vip.parse().expect("address"))
        };
        ServicePort {
            name: format!("fuzz/{vip}:{port}"),
            kind: if scope == SCOPE_NODEPORT {
                AddressKind::NodePort
            } else {
                AddressKind::ClusterIp
            },
            key: ServiceKey {
                addr,
                port_be: port.to_be_bytes(),
                protocol,
                scope,
            },
            affinity_timeout: affinity,
            ready,
            terminating: Vec::new(),
            source_ranges: Vec::new(),
            topology: None,
        }
    };
    let ports = vec![
        service(
            "10.96.0.10",
            80,
            6,
            SCOPE_CLUSTER,
            &["10.244.1.3:8080", "10.244.2.5:8080"],
            0,
        ),
        service("10.96.0.10", 53, 17, SCOPE_CLUSTER, &["10.244.1.3:5353"], 0),
        service(
            "10.96.0.11",
            80,
            6,
            SCOPE_CLUSTER,
            &["10.244.2.5:8080", "10.244.3.7:8080"],
            10_800,
        ),
        service(
            "10.96.0.12",
            3868,
            132,
            SCOPE_CLUSTER,
            &["10.244.1.3:3868"],
            0,
        ),
        service("10.96.0.13", 80, 6, SCOPE_CLUSTER, &[], 0),
        service(
            "fd00:10:96::10",
            53,
            17,
            SCOPE_CLUSTER,
            &["[fd00:102a:0:2::5]:5353"],
            0,
        ),
        service(
            "",
            30080,
            6,
            SCOPE_NODEPORT,
            &["10.244.1.3:8080", "10.244.2.5:8080"],
            0,
        ),
        service("", 30053, 17, SCOPE_NODEPORT, &["10.244.2.5:5353"], 0),
    ];
    fixture.sync_lb(&mut LbState::default(), &ports)?;
    fixture.sync_node_addresses(&["10.99.0.1".parse()?, "fd99::1".parse()?])?;
    let firewall: EgressFirewall = serde_yaml::from_str(
        "apiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\n\
         metadata: {name: default, namespace: default}\n\
         spec:\n  egress:\n\
         \x20 - {type: Allow, to: {cidrSelector: 8.8.8.0/24}, ports: [{protocol: TCP, port: 443}]}\n\
         \x20 - {type: Deny, to: {cidrSelector: 0.0.0.0/0}}\n\
         \x20 - {type: Deny, to: {cidrSelector: \"::/0\"}}\n",
    )?;
    let context = FirewallContext {
        exempt: [
            "10.244.0.0/16",
            "10.96.0.0/16",
            "fd00:102a::/32",
            "fd00:10:96::/112",
        ]
        .iter()
        .map(|n| n.parse().expect("CIDR"))
        .collect(),
        node_addresses: vec!["10.99.0.1".parse()?],
    };
    let mut desired = compile_firewalls(
        &[std::sync::Arc::new(firewall)],
        &context,
        &DnsAddresses::new(),
    )
    .desired;
    let policy: NetworkPolicy = serde_yaml::from_str(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
         metadata: {name: local-from-sender, namespace: default}\n\
         spec:\n  podSelector: {matchLabels: {app: local}}\n\
         \x20 ingress: [{from: [{podSelector: {matchLabels: {app: sender}}}], ports: [{port: 8080}]}]\n",
    )?;
    let pod = |name: &str, addresses: Vec<IpAddr>| PolicyPod {
        namespace: "default".into(),
        name: name.into(),
        labels: [("app".to_owned(), name.to_owned())].into(),
        addresses,
        named_ports: BTreeMap::new(),
    };
    let sender_addresses = vec![IpAddr::from(SRC_V4), IpAddr::from(SRC_V6)];
    let pods: PolicyPods = [
        pod("local", vec!["10.244.1.3".parse()?]),
        pod("sender", sender_addresses.clone()),
    ]
    .into_iter()
    .collect();
    let namespaces = dataplane_user::acl::pods::NamespaceLabels::default();
    let cluster = PolicyCluster::new(&pods, &namespaces);
    let local = ["default/local".to_owned(), "default/sender".to_owned()];
    let compiled = policy_sets(
        &[std::sync::Arc::new(policy)],
        &cluster,
        &local,
        &Default::default(),
        &Default::default(),
    );
    ensure!(compiled.errors.is_empty(), "{:?}", compiled.errors);
    desired = DesiredFirewalls {
        policy_sets: compiled.sets,
        pod_policies: compiled.pods,
        ..desired
    };
    let acl_pods = vec![
        AclPod {
            namespace: "default".into(),
            name: "local".into(),
            addresses: vec!["10.244.1.3".parse()?],
        },
        AclPod {
            namespace: "default".into(),
            name: "sender".into(),
            addresses: sender_addresses,
        },
    ];
    fixture.sync_acl(&mut AclState::default(), &desired, &acl_pods)?;
    crate::hybrid_bed::set_hybrid(&mut bed, Some(crate::hybrid_bed::hybrid_view(4789, true)))?;
    Ok(bed)
}

/// Well-formed frames for `program`, as scapy builds them: what its hook sees on a node.
fn seeds_for(program: &str) -> anyhow::Result<Vec<Vec<u8>>> {
    let exprs: Vec<String> = match program {
        PROG_FROM_POD => FROM_POD
            .iter()
            .map(|rest| format!("Ether(src='02:00:00:00:01:02', dst='02:00:00:00:01:01')/{rest}"))
            .collect(),
        PROG_TO_POD => TO_POD
            .iter()
            .map(|rest| format!("Ether(src='02:00:00:00:01:01', dst='02:00:00:00:01:02')/{rest}"))
            .collect(),
        _ => UNDERLAY
            .iter()
            .map(|rest| format!("Ether(src='02:00:00:00:99:02', dst='02:00:00:00:99:01')/{rest}"))
            .collect(),
    };
    let frames = scapy::build_many(&exprs)?;
    ensure!(frames.len() == exprs.len(), "scapy built every seed");
    Ok(frames)
}

/// What the test pod sends (after its Ethernet header).
const FROM_POD: &[&str] = &[
    "IP(src='10.244.1.2', dst='10.96.0.10')/TCP(sport=40000, dport=80, flags='S')",
    "IP(src='10.244.1.2', dst='10.96.0.10')/TCP(sport=40000, dport=80, flags='A')/Raw(b'x' * 40)",
    "IP(src='10.244.1.2', dst='10.96.0.10')/UDP(sport=40001, dport=53)/Raw(b'q' * 20)",
    "IP(src='10.244.1.2', dst='10.96.0.11')/TCP(sport=40002, dport=80, flags='S')",
    "IP(src='10.244.1.2', dst='10.96.0.13')/TCP(sport=40003, dport=80, flags='S')",
    "IP(src='10.244.1.2', dst='10.96.0.13')/UDP(sport=40003, dport=80)",
    "IP(src='10.244.1.2', dst='10.96.0.12')/SCTP(sport=3868, dport=3868)/SCTPChunkInit()",
    "IP(src='10.244.1.2', dst='10.244.2.7')/TCP(sport=40004, dport=8080, flags='S')",
    "IP(src='10.244.1.2', dst='10.244.3.7')/UDP(sport=40005, dport=5353)/Raw(b'x' * 1400)",
    "IP(src='10.244.1.2', dst='10.244.1.3')/TCP(sport=40006, dport=8080, flags='S')",
    "IP(src='10.244.1.2', dst='8.8.8.8')/TCP(sport=40007, dport=443, flags='S')",
    "IP(src='10.244.1.2', dst='10.132.0.5')/TCP(sport=40017, dport=80, flags='S')",
    "IP(src='10.244.1.2', dst='10.133.0.5')/UDP(sport=40018, dport=53)",
    "IP(src='10.244.1.2', dst='1.1.1.1')/UDP(sport=40008, dport=53)",
    "IP(src='10.244.1.2', dst='10.244.2.7', options=[IPOption_RR()])/UDP(sport=40009, dport=7)",
    "IP(src='10.244.1.2', dst='10.244.2.7')/ICMP()/Raw(b'ping')",
    "IP(src='10.244.1.2', dst='10.244.2.7')/ICMP(type=3, code=3)/IP(src='10.244.2.7', dst='10.244.1.2')/UDP(sport=53, dport=40001)",
    "IP(src='10.244.1.2', dst='10.96.0.10', id=99, flags='MF')/UDP(sport=40010, dport=53)/Raw(b'f' * 64)",
    "IP(src='10.244.1.2', dst='10.96.0.10', id=99, frag=9)/Raw(b'f' * 64)",
    "IPv6(src='fd00:102a:0:1::2', dst='fd00:10:96::10')/UDP(sport=40011, dport=53)",
    "IPv6(src='fd00:102a:0:1::2', dst='fd00:102a:0:2::7')/TCP(sport=40012, dport=80, flags='S')",
    "IPv6(src='fd00:102a:0:1::2', dst='fd00:102a:0:2::7')/IPv6ExtHdrHopByHop()/IPv6ExtHdrDestOpt()/UDP(sport=40013, dport=9)",
    "IPv6(src='fd00:102a:0:1::2', dst='fd00:102a:0:2::7')/IPv6ExtHdrFragment(id=7, m=1)/UDP(sport=40014, dport=9)/Raw(b'f' * 64)",
    "IPv6(src='fd00:102a:0:1::2', dst='fd00:102a:0:2::7')/IPv6ExtHdrFragment(id=7, offset=9)/Raw(b'f' * 64)",
    "IPv6(src='fd00:102a:0:1::2', dst='2001:db8::1')/ICMPv6EchoRequest()",
    "IPv6(src='fe80::ff:fe00:102', dst='ff02::1:ff00:1')/ICMPv6ND_NS(tgt='fe80::1')/ICMPv6NDOptSrcLLAddr(lladdr='02:00:00:00:01:02')",
    "IPv6(src='fd00:102a:0:1::2', dst='fe80::1')/ICMPv6ND_NA(tgt='fd00:102a:0:1::2')/ICMPv6NDOptDstLLAddr(lladdr='02:00:00:00:01:02')",
    "ARP(op=1, hwsrc='02:00:00:00:01:02', psrc='10.244.1.2', pdst='10.244.1.1')",
    "IP(src='0.0.0.0', dst='255.255.255.255')/UDP(sport=68, dport=67)/Raw(b'd' * 240)",
    "Dot1Q(vlan=5)/IP(src='10.244.1.2', dst='10.244.2.7')/UDP(sport=40015, dport=9)",
    "IP(src='10.244.1.3', dst='10.244.2.7')/UDP(sport=40016, dport=9)",
    "IP(src='10.99.0.3', dst='10.99.0.2')/UDP(sport=49152, dport=6081)/GENEVE(vni=1, proto=0x6558)/Ether()/IP(src='10.244.2.9', dst='10.244.1.3')/TCP()",
];

/// What the stack delivers to the test pod.
const TO_POD: &[&str] = &[
    "IP(src='10.244.2.7', dst='10.244.1.2')/TCP(sport=8080, dport=40000, flags='SA')",
    "IP(src='10.244.1.3', dst='10.244.1.2')/UDP(sport=5353, dport=40001)",
    "IP(src='10.99.0.100', dst='10.244.1.2')/TCP(sport=50000, dport=8080, flags='S')",
    "IP(src='10.99.0.254', dst='10.244.1.2')/ICMP(type=3, code=4, nexthopmtu=1400)/IP(src='10.244.1.2', dst='10.244.2.7')/TCP(sport=40004, dport=8080)",
    "IP(src='10.244.2.7', dst='10.244.1.2', id=5, flags='MF')/UDP(sport=9, dport=40002)/Raw(b'f' * 64)",
    "IP(src='10.244.2.7', dst='10.244.1.2', id=5, frag=9)/Raw(b'f' * 64)",
    "IP(src='10.244.2.7', dst='10.244.1.255')/UDP(sport=9, dport=9)",
    "IPv6(src='fd00:102a:0:2::7', dst='fd00:102a:0:1::2')/TCP(sport=80, dport=40012, flags='SA')",
    "IPv6(src='fe80::1', dst='ff02::1')/ICMPv6ND_RA()",
    "ARP(op=2, hwsrc='02:00:00:00:01:01', psrc='10.244.1.1', hwdst='02:00:00:00:01:02', pdst='10.244.1.2')",
];

/// What the underlay NIC receives: Geneve from the other nodes, NodePort clients, replies,
/// the node's own traffic.
const UNDERLAY: &[&str] = &[
    "IP(src='10.99.0.2', dst='10.99.0.1')/UDP(sport=49152, dport=6081)/GENEVE(vni=1, proto=0x6558)/Ether(src='0a:58:0a:f4:02:07', dst='02:00:00:00:01:03')/IP(src='10.244.2.7', dst='10.244.1.3')/TCP(sport=40000, dport=8080, flags='S')",
    "IP(src='10.99.0.2', dst='10.99.0.1')/UDP(sport=49153, dport=6081)/GENEVE(vni=1, proto=0x6558)/Ether(src='0a:58:0a:f4:02:05', dst='02:00:00:00:01:02')/IP(src='10.244.2.5', dst='10.244.1.2')/UDP(sport=5353, dport=40001)",
    "IPv6(src='fd99::3', dst='fd99::1')/UDP(sport=49154, dport=6081)/GENEVE(vni=1, proto=0x6558)/Ether()/IP(src='10.244.3.7', dst='10.244.1.3')/UDP(sport=9, dport=9)",
    "IP(src='10.99.0.2', dst='10.99.0.1')/UDP(sport=49155, dport=6081)/GENEVE(vni=5, proto=0x6558)/Ether()/IP(src='10.244.2.7', dst='10.244.1.3')/TCP()",
    "Dot1Q(vlan=7)/IP(src='10.99.0.2', dst='10.99.0.1')/UDP(sport=49156, dport=6081)/GENEVE(vni=1, proto=0x6558)/Ether()/IP(src='10.244.2.7', dst='10.244.1.3')/TCP()",
    "IP(src='10.99.0.100', dst='10.99.0.1')/TCP(sport=50000, dport=30080, flags='S')",
    "IP(src='10.99.0.100', dst='10.99.0.1')/TCP(sport=50000, dport=30080, flags='A')/Raw(b'x' * 100)",
    "IP(src='10.99.0.100', dst='10.99.0.1')/UDP(sport=50001, dport=30053)/Raw(b'q' * 30)",
    "IP(src='10.99.0.2', dst='10.99.0.1')/UDP(sport=49157, dport=6081)/GENEVE(vni=1, proto=0x6558)/Ether()/IP(src='10.244.2.5', dst='10.99.0.1')/TCP(sport=8080, dport=61000, flags='SA')",
    "IP(src='10.99.0.100', dst='10.99.0.1')/TCP(sport=50002, dport=22, flags='S')",
    "IP(src='10.99.0.254', dst='10.99.0.1')/ICMP(type=3, code=4)/IP(src='10.99.0.1', dst='10.99.0.100')/TCP(sport=30080, dport=50000)",
    "IP(src='10.99.0.100', dst='10.99.0.1', id=11, flags='MF')/UDP(sport=50003, dport=30053)/Raw(b'f' * 64)",
    "IP(src='10.99.0.100', dst='10.99.0.1', id=11, frag=9)/Raw(b'f' * 64)",
    "IP(src='10.244.2.7', dst='10.244.1.3')/TCP(sport=40000, dport=8080, flags='S')",
    "IPv6(src='fd99::3', dst='fd99::1')/ICMPv6EchoRequest()",
    "ARP(op=1, psrc='10.99.0.2', pdst='10.99.0.1')",
    "IP(src='10.99.0.20', dst='10.99.0.1')/UDP(sport=51000, dport=4789, chksum=0)/VXLAN(flags=0x08, vni=4097)/Ether(src='00:15:5d:00:00:20', dst='0a:58:0a:f4:01:33')/IP(src='10.132.0.5', dst='10.244.1.3')/TCP(sport=40000, dport=8080, flags='S')",
    "IP(src='10.99.0.20', dst='10.99.0.1')/UDP(sport=51001, dport=4789, chksum=0)/VXLAN(flags=0x08, vni=4097)/Ether(src='00:15:5d:00:00:20', dst='0a:58:0a:f4:01:33')/IP(src='10.132.0.5', dst='10.96.0.10')/UDP(sport=5353, dport=53)",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_keep_frames_within_bounds_and_are_reproducible() {
        let seeds = vec![vec![0u8; 60], vec![1u8; 1500]];
        let run = |seed| {
            let mut rng = XorShift::new(seed);
            (0..2000)
                .map(|_| mutated(&seeds, &mut rng))
                .collect::<Vec<_>>()
        };
        let frames = run(7);
        assert_eq!(frames, run(7), "same seed, same frames");
        assert_ne!(frames, run(8));
        assert!(
            frames
                .iter()
                .all(|f| (MIN_FRAME..=MAX_FRAME).contains(&f.len()))
        );
    }

    #[test]
    fn the_pod_check_refuses_other_sources() {
        let mut frame = vec![0u8; 60];
        frame[6..12].copy_from_slice(&POD_MAC);
        frame[12..14].copy_from_slice(&[0x08, 0x00]);
        frame[26..30].copy_from_slice(&SRC_V4);
        assert!(sent_as_the_pod(&frame).is_ok());
        frame[29] ^= 1;
        assert!(sent_as_the_pod(&frame).is_err());
    }
}
