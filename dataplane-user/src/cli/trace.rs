//! `dataplane trace`: one described packet run through the real programs with
//! BPF_PROG_TEST_RUN, against copies of the node's maps, so that nothing live changes (no
//! conntrack entry, affinity, counter or audit record appears in the node's maps).
//!
//! The programs are loaded a second time under a private pin root; every pinned map of the
//! node is copied into its twin there, except the counters, which start at zero so that the
//! counters the run leaves are exactly this packet's stage decisions. A packet from a local pod
//! goes through `tc_from_pod` (and its tail call); any other source is taken as arriving on the
//! underlay (`xdp_underlay`, then `tc_underlay` when XDP passes it up; `tc_underlay` alone
//! where the uplink runs no XDP). The report lists the
//! counters each hook hit, the entries the run created in the stateful tables (which backend a
//! service flow got, policy flows, an egress flow's address and translation), the verdict, and the packet as it left.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    os::fd::{AsFd as _, AsRawFd as _},
    path::Path,
};

use aya::maps::{DevMapHash, HashMap, MapData, MapInfo, MapType};
use dataplane_common::{
    maps::{self, ALL_MAPS, LOCAL_PODS, PROG_FROM_POD, PROG_UNDERLAY, PROG_UNDERLAY_TC},
    overlay::{Addr, LocalPod},
};
use etherparse::{NetSlice, PacketBuilder, SlicedPacket, TransportSlice};
use serde::Serialize;

use crate::kernel::attach::LinkPin;
use crate::kernel::capacity::map_err;
use crate::{
    acl::{
        explain::{PolicyMaps, SetRules},
        pods::Direction,
    },
    cli::inspect::{self, Table},
    error::AgentError,
    kernel::loader::Dataplane,
    kernel::netdev,
    kernel::pins::Pins,
    kernel::stats,
    mapsync::addr16,
};

/// Transport of the described packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
pub enum Protocol {
    Tcp,
    Udp,
    Icmp,
}

/// The packet to trace.
#[derive(Clone, Debug)]
pub struct Described {
    pub from: IpAddr,
    pub to: IpAddr,
    pub protocol: Protocol,
    pub source_port: u16,
    /// Destination port (ignored for ICMP, which sends an echo request).
    pub port: u16,
}

#[derive(Debug, Serialize)]
pub struct Report {
    /// `from_pod` or `underlay`.
    pub entry: &'static str,
    pub input: String,
    pub steps: Vec<Step>,
    /// Entries the run created in the conntrack, affinity, policy and egress IP tables (an
    /// egress flow's chosen address and its translation).
    pub created: Vec<Created>,
    /// What access control decided for the flow, by the live policy sets: the sender's
    /// egress and the receiver's ingress (local pods judged in that direction only), naming
    /// the tier, policy and rule that decided.
    pub policy: Vec<String>,
    /// For a pod's flow to a service port: whether the socket-level translation gives it a
    /// backend before any packet leaves (and the per-packet run below is then what sockets
    /// opened earlier meet), or why it is left per packet.
    pub socket: Option<String>,
    /// The packet sent in and the last program's output.
    #[serde(skip)]
    frames: (Vec<u8>, Vec<u8>),
}

#[derive(Debug, Serialize)]
pub struct Step {
    pub program: &'static str,
    pub verdict: String,
    /// Counters this run incremented in the program's hook: packet classes and drop reasons.
    pub decisions: Vec<String>,
    pub output: String,
}

#[derive(Debug, Serialize)]
pub struct Created {
    pub table: &'static str,
    pub entry: String,
}

/// Maps not copied: counters (zero, to show this run's own), the layout stamp the loader
/// writes, and the audit and DNS answer rings.
const NOT_COPIED: &[&str] = &[
    maps::DROPS,
    maps::PACKETS,
    maps::META,
    maps::ACL_EVENTS,
    maps::ACL_DNS,
    // The socket-level translation's: no packet program reads them.
    maps::SOCK_LB_PODS,
    maps::SOCK_LB_REV,
    maps::SOCK_LB_STATS,
];

/// Runs `packet` through copies of the programs and maps pinned under `live`; `rules` (what
/// the agent wrote of its policy sets) names the policies that decide.
pub fn trace(
    live: &Pins,
    packet: &Described,
    rules: &BTreeMap<u32, SetRules>,
) -> Result<Report, AgentError> {
    if !live.map(maps::META).exists() {
        return Err(AgentError::NotRunning {
            pins: live.root().to_path_buf(),
        });
    }
    let private = Pins::new(
        live.root()
            .with_file_name(format!("dataplane-trace-{}", std::process::id())),
    );
    let result = trace_in(live, &private, packet).and_then(|mut report| {
        report.policy = policy_decisions(live, &report, rules)?;
        Ok(report)
    });
    if let Err(error) = private.remove_all() {
        tracing::warn!(%error, "removing the trace's private pins");
    }
    result
}

fn trace_in(live: &Pins, private: &Pins, packet: &Described) -> Result<Report, AgentError> {
    let mut copy = Dataplane::load(private)?;
    for &name in ALL_MAPS.iter().filter(|n| !NOT_COPIED.contains(n)) {
        copy_map(&live.map(name), &private.map(name), name)?;
    }
    fill_xdp_pods(live, &mut copy)?;
    let local = local_pod(live, packet.from)?;
    let frame = build_frame(packet, local.as_ref())?;
    let before = stateful_rows(live)?;
    let mut steps = Vec::new();
    let mut last_output = frame.clone();
    let socket = match (&local, flow_of(&frame)) {
        (Some(pod), Some((_, dst, protocol, port))) => {
            crate::lb::socket::flow_path(live, pod.ifindex, dst, protocol, port)?
        }
        _ => None,
    };
    let entry = if let Some(pod) = &local {
        // Run on the pod's own veth: port security checks the sender against the record of
        // the interface the frame came in on.
        let outcome = copy.run_tc_on(PROG_FROM_POD, &frame, 1, pod.ifindex)?;
        steps.push(step(
            private,
            PROG_FROM_POD,
            tc_verdict(outcome.action),
            &outcome.output,
        )?);
        last_output = outcome.output;
        "from_pod"
    } else {
        // Where the uplink runs no XDP (`--uplink-hook tc`), tc sees the frame first.
        let mut passed = true;
        if uplink_runs_xdp(live) {
            let outcome = copy.run_xdp(PROG_UNDERLAY, &frame, 1)?;
            passed = outcome.action == XDP_PASS;
            steps.push(step(
                private,
                PROG_UNDERLAY,
                xdp_verdict(outcome.action),
                &outcome.output,
            )?);
            last_output.clone_from(&outcome.output);
        }
        if passed {
            let outcome = copy.run_tc(PROG_UNDERLAY_TC, &last_output, 1)?;
            steps.push(step(
                private,
                PROG_UNDERLAY_TC,
                tc_verdict(outcome.action),
                &outcome.output,
            )?);
            last_output = outcome.output;
        }
        "underlay"
    };
    let after = stateful_rows(private)?;
    let created = after
        .into_iter()
        .filter(|row| !before.contains(row))
        .map(|(table, entry)| Created { table, entry })
        .collect();
    Ok(Report {
        entry,
        input: describe_frame(&frame),
        steps,
        created,
        policy: Vec::new(),
        socket,
        frames: (frame, last_output),
    })
}

/// Whether the live agent runs XDP on its uplink: an `xdp_underlay` link pinned (none with
/// `--uplink-hook tc`).
fn uplink_runs_xdp(live: &Pins) -> bool {
    live.link_names()
        .iter()
        .filter_map(|name| LinkPin::parse(name))
        .any(|pin| pin.program == PROG_UNDERLAY)
}

/// The copy's `DP_XDP_PODS` as the agent fills its own (not pinned, so not copied): the local
/// pods' veths whose pod end takes frames from XDP, so a frame the agent's XDP would hand
/// straight to a pod shows so here too.
fn fill_xdp_pods(live: &Pins, copy: &mut Dataplane) -> Result<(), AgentError> {
    let pods = pinned_local_pods(live)?;
    let veths: BTreeSet<u32> = pods
        .iter()
        .filter_map(Result::ok)
        .map(|(_, pod)| pod.ifindex)
        .filter(|ifindex| netdev::takes_xdp(*ifindex))
        .collect();
    let mut map: DevMapHash<&mut MapData> = copy.typed_map(maps::XDP_PODS)?;
    for ifindex in veths {
        map.insert(ifindex, ifindex, None, 0)
            .map_err(|source| AgentError::XdpMap {
                name: maps::XDP_PODS,
                action: "copy for the trace",
                source,
            })?;
    }
    Ok(())
}

/// The policy decisions for the traced flow: from the input packet's source to the last
/// output's destination (after any load-balancing; inside a Geneve packet, the inner one).
fn policy_decisions(
    live: &Pins,
    report: &Report,
    rules: &BTreeMap<u32, SetRules>,
) -> Result<Vec<String>, AgentError> {
    let (input, output) = &report.frames;
    let (Some(sent), Some(left)) = (flow_of(input), flow_of(output)) else {
        return Ok(Vec::new());
    };
    let maps = PolicyMaps::open(live)?;
    let (src, dst, protocol, port) = (sent.0, left.1, left.2, left.3);
    let mut out = Vec::new();
    for (pod, direction, peer, what) in [
        (src, Direction::Egress, dst, "egress"),
        (dst, Direction::Ingress, src, "ingress"),
    ] {
        if let Some(decided) = maps.decide(pod, direction, peer, protocol, port) {
            out.push(format!("{what} of {pod}: {}", decided.describe(rules)));
        }
    }
    Ok(out)
}

/// Source, destination, IP protocol and destination port of a frame's IP packet (the inner
/// one of a Geneve packet).
fn flow_of(frame: &[u8]) -> Option<(IpAddr, IpAddr, u8, u16)> {
    let packet = SlicedPacket::from_ethernet(frame).ok()?;
    if let Some(TransportSlice::Udp(udp)) = &packet.transport
        && let Some((_, inner)) = geneve_inner(udp.payload())
    {
        return flow_of(inner);
    }
    let (src, dst, protocol): (IpAddr, IpAddr, u8) = match &packet.net {
        Some(NetSlice::Ipv4(ip)) => (
            ip.header().source_addr().into(),
            ip.header().destination_addr().into(),
            ip.header().protocol().0,
        ),
        Some(NetSlice::Ipv6(ip)) => (
            ip.header().source_addr().into(),
            ip.header().destination_addr().into(),
            ip.payload().ip_number.0,
        ),
        _ => return None,
    };
    let port = match &packet.transport {
        Some(TransportSlice::Tcp(tcp)) => tcp.destination_port(),
        Some(TransportSlice::Udp(udp)) => udp.destination_port(),
        _ => 0,
    };
    Some((src, dst, protocol, port))
}

/// One program's step: its verdict, the counters of the private copy (cumulative over the
/// steps so far, so each step shows its own hook's rows), and its output packet.
fn step(
    private: &Pins,
    program: &'static str,
    verdict: String,
    output: &[u8],
) -> Result<Step, AgentError> {
    let hook = match program {
        PROG_FROM_POD => "from_pod",
        PROG_UNDERLAY => "underlay",
        _ => "underlay_tc",
    };
    let counters = stats::read(private)?;
    let mut decisions: Vec<String> = counters
        .packets
        .iter()
        .filter(|p| p.hook == hook && p.class != "total")
        .map(|p| p.class.to_owned())
        .collect();
    // Drop counters are per reason, not per hook: shown at the step that dropped.
    if verdict.starts_with("drop") || verdict.starts_with("shot") {
        decisions.extend(counters.drops.iter().map(|d| format!("drop: {}", d.reason)));
    }
    Ok(Step {
        program,
        verdict,
        decisions,
        output: describe_frame(output),
    })
}

/// The rows of the tables a packet can add to, as (table, row text).
fn stateful_rows(pins: &Pins) -> Result<BTreeSet<(&'static str, String)>, AgentError> {
    let mut rows = BTreeSet::new();
    for (name, table) in [
        ("conntrack", Table::Conntrack),
        ("affinity", Table::Affinity),
        ("policy", Table::Policy),
        ("egressip", Table::Egressip),
    ] {
        for row in inspect::read(pins, table, &BTreeMap::new())?.rows {
            let cells: Vec<String> = row.iter().map(ToString::to_string).collect();
            rows.insert((name, cells.join(" ")));
        }
    }
    Ok(rows)
}

/// The local pod at `ip`, if it runs on this node.
fn local_pod(pins: &Pins, ip: IpAddr) -> Result<Option<LocalPod>, AgentError> {
    match pinned_local_pods(pins)?.get(&addr16(ip), 0) {
        Ok(pod) => Ok(Some(pod)),
        Err(aya::maps::MapError::KeyNotFound) => Ok(None),
        Err(source) => Err(map_err(LOCAL_PODS, "read")(source)),
    }
}

/// The local-pod map pinned under `pins`.
fn pinned_local_pods(pins: &Pins) -> Result<HashMap<MapData, Addr, LocalPod>, AgentError> {
    pins.open_hash(LOCAL_PODS, false)
}

/// The frame for `packet`: from a local pod as its veth delivers it (pod MAC to the host-side
/// MAC), from elsewhere as the underlay receives it.
fn build_frame(packet: &Described, local: Option<&LocalPod>) -> Result<Vec<u8>, AgentError> {
    let (source_mac, destination_mac) = match local {
        Some(pod) => (pod.pod_mac, pod.host_mac),
        None => ([0x02, 0, 0, 0, 0, 0xfe], [0x02, 0, 0, 0, 0, 0xff]),
    };
    let ethernet = PacketBuilder::ethernet2(source_mac, destination_mac);
    let ip = match (packet.from, packet.to) {
        (IpAddr::V4(from), IpAddr::V4(to)) => ethernet.ipv4(from.octets(), to.octets(), 64),
        (IpAddr::V6(from), IpAddr::V6(to)) => ethernet.ipv6(from.octets(), to.octets(), 64),
        (from, to) => return Err(AgentError::MixedFamilies { from, to }),
    };
    let payload = b"dataplane trace";
    let mut frame = Vec::new();
    let written = match (packet.protocol, packet.to) {
        (Protocol::Tcp, _) => ip
            .tcp(packet.source_port, packet.port, 1, 64240)
            .syn()
            .write(&mut frame, &[]),
        (Protocol::Udp, _) => ip
            .udp(packet.source_port, packet.port)
            .write(&mut frame, payload),
        (Protocol::Icmp, IpAddr::V4(_)) => ip.icmpv4_echo_request(1, 1).write(&mut frame, payload),
        (Protocol::Icmp, IpAddr::V6(_)) => ip.icmpv6_echo_request(1, 1).write(&mut frame, payload),
    };
    written.map_err(AgentError::TracePacket)?;
    Ok(frame)
}

const XDP_PASS: u32 = 2;

fn xdp_verdict(action: u32) -> String {
    match action {
        0 => "aborted".into(),
        1 => "drop".into(),
        2 => "pass (up the stack)".into(),
        3 => "tx (back out of the NIC)".into(),
        4 => "redirect".into(),
        other => format!("action {other}"),
    }
}

fn tc_verdict(action: u32) -> String {
    match action {
        0 => "ok (on through the stack)".into(),
        2 => "shot (dropped)".into(),
        7 => "redirect (to the interface the program chose)".into(),
        u32::MAX => "unspec (next program)".into(),
        other => format!("action {other}"),
    }
}

/// One line per header: Ethernet, IP, transport; a Geneve packet's inner frame follows.
pub fn describe_frame(frame: &[u8]) -> String {
    let Ok(packet) = SlicedPacket::from_ethernet(frame) else {
        return format!("{} bytes, not decodable", frame.len());
    };
    let mut text = String::new();
    if let Some(etherparse::LinkSlice::Ethernet2(eth)) = &packet.link {
        text.push_str(&format!(
            "eth {} > {}",
            netdev::mac_text(&eth.source()),
            netdev::mac_text(&eth.destination())
        ));
    }
    match &packet.net {
        Some(NetSlice::Ipv4(ip)) => text.push_str(&format!(
            ", ip {} > {} ttl {}",
            ip.header().source_addr(),
            ip.header().destination_addr(),
            ip.header().ttl()
        )),
        Some(NetSlice::Ipv6(ip)) => text.push_str(&format!(
            ", ip6 {} > {} hlim {}",
            ip.header().source_addr(),
            ip.header().destination_addr(),
            ip.header().hop_limit()
        )),
        _ => {}
    }
    match &packet.transport {
        Some(TransportSlice::Tcp(tcp)) => {
            let flags = [
                (tcp.syn(), 'S'),
                (tcp.ack(), 'A'),
                (tcp.fin(), 'F'),
                (tcp.rst(), 'R'),
            ]
            .iter()
            .filter(|(set, _)| *set)
            .map(|(_, c)| *c)
            .collect::<String>();
            text.push_str(&format!(
                ", tcp {} > {} [{flags}]",
                tcp.source_port(),
                tcp.destination_port()
            ));
        }
        Some(TransportSlice::Udp(udp)) => {
            text.push_str(&format!(
                ", udp {} > {}",
                udp.source_port(),
                udp.destination_port()
            ));
            if let Some(inner) = geneve_inner(udp.payload()) {
                text.push_str(&format!(
                    " | geneve vni {} | {}",
                    inner.0,
                    describe_frame(inner.1)
                ));
            }
        }
        Some(TransportSlice::Icmpv4(icmp)) => {
            text.push_str(&format!(", icmp {:?}", icmp.icmp_type()));
        }
        Some(TransportSlice::Icmpv6(icmp)) => {
            text.push_str(&format!(", icmp6 {:?}", icmp.icmp_type()));
        }
        _ => {}
    }
    text
}

/// The VNI and inner Ethernet frame of a Geneve payload (RFC 8926: 8-byte header, options of
/// `opt len` 4-byte words, protocol 0x6558 for Ethernet).
fn geneve_inner(payload: &[u8]) -> Option<(u32, &[u8])> {
    let header = payload.get(..8)?;
    let options = usize::from(header[0] & 0x3f) * 4;
    if header[0] >> 6 != 0 || u16::from_be_bytes([header[2], header[3]]) != 0x6558 {
        return None;
    }
    let vni = u32::from_be_bytes([0, header[4], header[5], header[6]]);
    Some((vni, payload.get(8 + options..)?))
}

/// The report as text.
pub fn render(report: &Report) -> String {
    let mut out = format!("packet: {}\nentry:  {}\n", report.input, report.entry);
    if let Some(socket) = &report.socket {
        out.push_str(&format!("path:   {socket}\n"));
    }
    for step in &report.steps {
        out.push_str(&format!("\n{}: {}\n", step.program, step.verdict));
        for decision in &step.decisions {
            out.push_str(&format!("  - {decision}\n"));
        }
        out.push_str(&format!("  out: {}\n", step.output));
    }
    if !report.policy.is_empty() {
        out.push_str("\npolicy:\n");
        for decision in &report.policy {
            out.push_str(&format!("  {decision}\n"));
        }
    }
    if !report.created.is_empty() {
        out.push_str("\ncreated (in the copies only):\n");
        for created in &report.created {
            out.push_str(&format!("  {:<10} {}\n", created.table, created.entry));
        }
    }
    out
}

/// Copies every entry of the map pinned at `from` into the one pinned at `to` (same
/// definition). aya's typed maps need the key and value types at compile time; this copy
/// works from the sizes the kernel reports, so it serves every map, per-CPU ones included.
fn copy_map(from: &Path, to: &Path, name: &'static str) -> Result<usize, AgentError> {
    let err = |action| map_err(name, action);
    let info = MapInfo::from_pin(from).map_err(err("read info"))?;
    let map_type = info.map_type().map_err(err("read type"))?;
    if matches!(map_type, MapType::RingBuf | MapType::ProgramArray) {
        return Ok(0);
    }
    let per_cpu = matches!(
        map_type,
        MapType::PerCpuArray | MapType::PerCpuHash | MapType::LruPerCpuHash
    );
    let cpus = if per_cpu {
        aya::util::nr_cpus().map_err(|(_, e)| AgentError::CpuCount(e))?
    } else {
        1
    };
    let value_size = if per_cpu {
        (info.value_size() as usize).div_ceil(8) * 8 * cpus
    } else {
        info.value_size() as usize
    };
    let source = MapData::from_pin(from).map_err(err("open"))?;
    let target = MapData::from_pin(to).map_err(err("open the copy"))?;
    let (source, target) = (
        source.fd().as_fd().as_raw_fd(),
        target.fd().as_fd().as_raw_fd(),
    );
    let mut key = vec![0u8; info.key_size() as usize];
    let mut next = key.clone();
    let mut value = vec![0u8; value_size];
    let mut first = true;
    let mut copied = 0;
    loop {
        let more = bpf_elem(
            BPF_MAP_GET_NEXT_KEY,
            source,
            (!first).then_some(key.as_ptr()),
            next.as_mut_ptr(),
        );
        if !more {
            break;
        }
        first = false;
        key.copy_from_slice(&next);
        // An entry deleted between the two calls (an LRU eviction) is skipped.
        if bpf_elem(
            BPF_MAP_LOOKUP_ELEM,
            source,
            Some(key.as_ptr()),
            value.as_mut_ptr(),
        ) && bpf_elem(
            BPF_MAP_UPDATE_ELEM,
            target,
            Some(key.as_ptr()),
            value.as_mut_ptr(),
        ) {
            copied += 1;
        }
    }
    Ok(copied)
}

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;

/// `union bpf_attr` as the element commands read it.
#[repr(C)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    /// The value, or the next key for GET_NEXT_KEY.
    value: u64,
    flags: u64,
}

/// One element command; true on success. A null key asks GET_NEXT_KEY for the first key.
fn bpf_elem(command: libc::c_long, fd: i32, key: Option<*const u8>, value: *mut u8) -> bool {
    let attr = ElemAttr {
        map_fd: fd as u32,
        _pad: 0,
        key: key.map_or(0, |k| k as u64),
        value: value as u64,
        flags: 0,
    };
    // SAFETY: attr is a valid bpf_attr prefix for the element commands; key and value point to
    // buffers of the map's key size and (per-CPU adjusted) value size, which outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            command,
            &attr as *const ElemAttr,
            std::mem::size_of::<ElemAttr>(),
        )
    };
    rc == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_described_header_by_header_through_geneve() {
        let inner = {
            let mut frame = Vec::new();
            PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2])
                .ipv4([10, 244, 1, 2], [10, 244, 2, 3], 63)
                .tcp(40000, 8080, 1, 1000)
                .syn()
                .write(&mut frame, &[])
                .expect("inner");
            frame
        };
        let mut geneve = vec![0, 0, 0x65, 0x58, 0, 0, 1, 0];
        geneve.extend_from_slice(&inner);
        let mut outer = Vec::new();
        PacketBuilder::ethernet2([2, 0, 0, 0, 0, 3], [2, 0, 0, 0, 0, 4])
            .ipv4([192, 168, 0, 1], [192, 168, 0, 2], 64)
            .udp(49152, 6081)
            .write(&mut outer, &geneve)
            .expect("outer");
        assert_eq!(
            describe_frame(&outer),
            "eth 02:00:00:00:00:03 > 02:00:00:00:00:04, ip 192.168.0.1 > 192.168.0.2 ttl 64, \
             udp 49152 > 6081 | geneve vni 1 | eth 02:00:00:00:00:01 > 02:00:00:00:00:02, \
             ip 10.244.1.2 > 10.244.2.3 ttl 63, tcp 40000 > 8080 [S]"
        );
    }
}
