//! Two simulated nodes with two pods each, the real agent on each node, real traffic.

use aya::maps::{Array, Map, MapData};
use dataplane_common::{
    DropReason, Hook, PacketClass,
    maps::{LAYOUT_VERSION, META},
};
use dataplane_tests::{
    packets,
    privileged::privileged,
    topology::{Topology, dataplane_binary, exec_in},
};
use dataplane_user::stats::Counters;
use std::process::Command;

fn delta(after: &Counters, before: &Counters, hook: Hook, class: PacketClass) -> u64 {
    after.packets(hook, class) - before.packets(hook, class)
}

fn set_layout_version(pins: &dataplane_user::Pins, version: u32) {
    let data = MapData::from_pin(pins.map(META)).expect("open pinned meta map");
    let mut meta: Array<MapData, u32> = Array::try_from(Map::Array(data)).expect("array");
    meta.set(0, version, 0).expect("write layout version");
}

#[test]
fn agents_attach_count_real_traffic_stay_attached_and_adopt_pins_on_restart() {
    if !privileged("agents_attach_count_real_traffic_stay_attached_and_adopt_pins_on_restart") {
        return;
    }
    let topology = Topology::build(2, 2).expect("build topology");
    let (node0, node1) = (topology.node(0), topology.node(1));
    let agent0 = node0.start_agent().expect("agent on node 0");
    let agent1 = node1.start_agent().expect("agent on node 1");

    // What status reports: XDP on the underlay (auto: offload refused by veth, native taken),
    // tc on both pod veths.
    let status = agent0.status_json().expect("status --json");
    assert_eq!(status["agent"], "running");
    let attachments = status["state"]["attachments"]
        .as_array()
        .expect("attachments");
    let summary: Vec<(String, String, String)> = attachments
        .iter()
        .map(|a| {
            (
                a["interface"].as_str().unwrap_or_default().to_owned(),
                a["program"].as_str().unwrap_or_default().to_owned(),
                a["mode"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            ("eth0".into(), "xdp_underlay".into(), "native".into()),
            ("eth0".into(), "tc_underlay".into(), "tc-ingress".into()),
            ("vp0".into(), "tc_from_pod".into(), "tc-ingress".into()),
            ("vp0".into(), "tc_to_pod".into(), "tc-egress".into()),
            ("vp1".into(), "tc_from_pod".into(), "tc-ingress".into()),
            ("vp1".into(), "tc_to_pod".into(), "tc-egress".into()),
        ]
    );
    let link = exec_in(&node0.netns, &["ip", "link", "show", "eth0"]).expect("ip link");
    assert!(
        String::from_utf8_lossy(&link.stdout).contains("xdp"),
        "XDP visible on eth0"
    );

    // Cross-node ping: 3 requests leave pod 0.0 (node 0 from_pod) and arrive at node 1's
    // underlay; 3 replies leave pod 1.0 (node 1 from_pod) and arrive at node 0's underlay.
    let (before0, before1) = (agent0.counters().unwrap(), agent1.counters().unwrap());
    let pinger = &node0.pods[0];
    assert!(pinger.ping(node1.pods[0].ip, 3).unwrap(), "cross-node ping");
    let (after0, after1) = (agent0.counters().unwrap(), agent1.counters().unwrap());
    assert_eq!(
        delta(&after0, &before0, Hook::FromPod, PacketClass::Icmp),
        3
    );
    assert_eq!(
        delta(&after0, &before0, Hook::Underlay, PacketClass::Icmp),
        3
    );
    assert_eq!(
        delta(&after1, &before1, Hook::Underlay, PacketClass::Icmp),
        3
    );
    assert_eq!(
        delta(&after1, &before1, Hook::FromPod, PacketClass::Icmp),
        3
    );

    // Same-node ping: requests leave pod 0.0, replies leave pod 0.1; nothing on the underlay.
    let before0 = agent0.counters().unwrap();
    assert!(pinger.ping(node0.pods[1].ip, 3).unwrap(), "same-node ping");
    let after0 = agent0.counters().unwrap();
    assert_eq!(
        delta(&after0, &before0, Hook::FromPod, PacketClass::Icmp),
        6
    );
    assert_eq!(
        delta(&after0, &before0, Hook::Underlay, PacketClass::Icmp),
        0
    );

    // Malformed frames sent by a real pod are dropped at its veth with their reason, including
    // the short-L3 frames the kernel's test run cannot carry.
    let sender = &node0.pods[1];
    let v4 = packets::ipv4_udp();
    let v6 = packets::ipv6_udp();
    let mut bad_ihl = v4.clone();
    bad_ihl[packets::L3] = 0x44;
    for frame in [
        &v4[..packets::L3 + 10],
        &v6[..packets::L3 + 20],
        &bad_ihl[..],
    ] {
        sender.send_raw_frame(frame).expect("send raw frame");
    }
    let counters = agent0.counters().unwrap();
    assert_eq!(counters.drops(DropReason::Ipv4Truncated), 1);
    assert_eq!(counters.drops(DropReason::Ipv6Truncated), 1);
    assert_eq!(counters.drops(DropReason::Ipv4BadIhl), 1);
    assert_eq!(counters.packets(Hook::FromPod, PacketClass::Dropped), 3);

    // SIGTERM: clean exit; the programs stay attached through their pinned links and keep
    // forwarding and counting while no agent runs.
    let (pins, run_dir) = agent0.stop_keeping_pins().expect("stop agent 0");
    let link = exec_in(&node0.netns, &["ip", "link", "show", "eth0"]).expect("ip link");
    assert!(
        String::from_utf8_lossy(&link.stdout).contains("xdp"),
        "XDP stays attached after the agent exits"
    );
    assert!(
        pins.map(META).exists(),
        "maps stay pinned for the next agent"
    );
    // XDP and tc on the underlay, tc both ways on two pod veths.
    let links = pins.link_names();
    assert_eq!(links.len(), 6, "pinned links: {links:?}");
    assert!(
        links
            .iter()
            .any(|l| l.starts_with("xdp_underlay@") && l.ends_with("@native")),
        "{links:?}"
    );
    assert!(
        pinger.ping(node1.pods[0].ip, 2).unwrap(),
        "ping with no agent"
    );
    let icmp_total = counters.packets(Hook::FromPod, PacketClass::Icmp) + 2;
    let status = Command::new(dataplane_binary())
        .arg("--pin-root")
        .arg(pins.root())
        .arg("--run-dir")
        .arg(&run_dir)
        .args(["status", "--json"])
        .output()
        .expect("status");
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).expect("json");
    assert_eq!(status["agent"], "absent");
    assert_eq!(
        status["links"].as_array().map(Vec::len),
        Some(6),
        "{status}"
    );

    // A restarted agent refuses pins of another layout version, naming it...
    set_layout_version(&pins, LAYOUT_VERSION + 998);
    let refused = node0
        .start_agent_at(pins.clone(), run_dir.clone())
        .err()
        .expect("agent must refuse a foreign layout");
    assert!(
        format!("{refused:#}").contains(&format!("layout version {}", LAYOUT_VERSION + 998)),
        "{refused:#}"
    );

    // ...and adopts pins of its own version: the counters carry on from where they were.
    set_layout_version(&pins, LAYOUT_VERSION);
    let agent0 = node0
        .start_agent_at(pins, run_dir)
        .expect("restarted agent");
    assert!(
        agent0.log().contains("took over the pinned link"),
        "{}",
        agent0.log()
    );
    let adopted = agent0.counters().unwrap();
    assert_eq!(
        adopted.packets(Hook::FromPod, PacketClass::Icmp),
        icmp_total
    );
    assert_eq!(adopted.drops(DropReason::Ipv4BadIhl), 1);
    assert!(
        pinger.ping(node1.pods[0].ip, 1).unwrap(),
        "ping after restart"
    );
    let after = agent0.counters().unwrap();
    assert_eq!(
        after.packets(Hook::FromPod, PacketClass::Icmp),
        icmp_total + 1
    );
}
