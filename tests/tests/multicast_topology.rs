//! Multicast per namespace end to end: two nodes with four pods each, members and senders with
//! real sockets, the real agents snooping the pods' own IGMP and MLD and telling each other
//! their groups. Pods 0 and 1 of each node are in `team`, pod 2 in `other`, pod 3 in `quiet`,
//! which never enables multicast.

use std::{collections::BTreeSet, path::Path, thread, time::Duration};

use dataplane_common::{DropReason, Hook, PacketClass};
use dataplane_tests::{
    capture::Capture,
    multicast_bed::{Member, send, tagged},
    privileged::privileged,
    topology::{Agent, Mode, Topology, dataplane_json},
};
use serde_json::Value;

const PORT: u16 = 5000;
const SETTLE: Duration = Duration::from_millis(600);

/// The namespaces, `team` and `other` enabled as asked.
fn namespaces(team: bool, other: bool) -> String {
    let ns = |name: &str, on: bool| {
        let annotation = if on {
            ", annotations: {k8s.ovn.org/multicast-enabled: 'true'}"
        } else {
            ""
        };
        format!("---\napiVersion: v1\nkind: Namespace\nmetadata: {{name: {name}{annotation}}}\n")
    };
    ns("team", team) + &ns("other", other) + &ns("quiet", false)
}

/// Two nodes of four pods in their namespaces, agents querying every 2 s.
fn cluster(team: bool) -> (Topology, Vec<Agent>) {
    let mut topology = Topology::build_with(2, 4, Mode::Overlay).expect("topology");
    for node in 0..2 {
        for (pod, namespace) in ["team", "team", "other", "quiet"].iter().enumerate() {
            topology
                .set_pod_namespace(node, pod, namespace)
                .expect("namespace");
        }
    }
    topology
        .add_manifest("namespaces.yaml", &namespaces(team, true))
        .expect("namespaces");
    let args = ["--multicast-query-interval-seconds", "2"];
    let agents = vec![
        topology.node(0).start_agent_with(&args).expect("agent 0"),
        topology.node(1).start_agent_with(&args).expect("agent 1"),
    ];
    (topology, agents)
}

/// The agent's description of its groups (`multicast.json`).
fn groups(agent: &Agent) -> Value {
    std::fs::read_to_string(Path::new(&agent.run_dir).join("multicast.json"))
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or(Value::Null)
}

/// The local members (pod names) and member nodes of `group` in `namespace` on `agent`.
fn members(agent: &Agent, namespace: &str, group: &str) -> (Vec<String>, Vec<String>) {
    let described = groups(agent);
    let Some(entry) = described["groups"].as_array().and_then(|groups| {
        groups
            .iter()
            .find(|g| g["namespace"] == namespace && g["group"] == group)
    }) else {
        return (Vec::new(), Vec::new());
    };
    let local = entry["local"]
        .as_array()
        .map(|l| {
            l.iter()
                .filter_map(|m| m[0].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let remote = entry["remote"]
        .as_array()
        .map(|r| {
            r.iter()
                .filter_map(|n| n.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    (local, remote)
}

/// Waits until `agent` holds exactly these members of `group`.
fn wait_members(agent: &Agent, namespace: &str, group: &str, local: &[&str], remote: &[&str]) {
    let want = (
        local.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>(),
        remote.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>(),
    );
    for _ in 0..100 {
        if members(agent, namespace, group) == want {
            return;
        }
        thread::sleep(Duration::from_millis(100));
    }
    panic!(
        "{namespace} {group}: want {want:?}, have {:?}\n{}",
        members(agent, namespace, group),
        agent.log()
    );
}

fn counter(agent: &Agent, hook: Hook, class: PacketClass) -> u64 {
    agent.counters().expect("counters").packets(hook, class)
}

fn drops(agent: &Agent, reason: DropReason) -> u64 {
    agent.counters().expect("counters").drops(reason)
}

#[test]
fn ipv4_multicast_reaches_the_members_of_the_senders_namespace_only() {
    if !privileged("ipv4_multicast_reaches_the_members_of_the_senders_namespace_only") {
        return;
    }
    let (topology, mut agents) = cluster(false);
    let pod = |node: usize, index: usize| topology.node(node).pods[index].netns.clone();
    let group = "224.5.5.5";

    // 1. Default deny: members joined, the namespace not enabled.
    let near = Member::join(&pod(0, 1), &[group], PORT).expect("member");
    let far = Member::join(&pod(1, 0), &[group], PORT).expect("member");
    let disabled = drops(&agents[0], DropReason::MulticastDisabled);
    send(&pod(0, 0), group, PORT, 2, 3, "off").expect("send");
    assert!(tagged(&near.received(SETTLE), "off").is_empty());
    assert!(tagged(&far.received(Duration::ZERO), "off").is_empty());
    assert_eq!(
        drops(&agents[0], DropReason::MulticastDisabled),
        disabled + 3,
        "each datagram of a disabled namespace counted once"
    );
    assert_eq!(
        members(&agents[0], "team", group),
        (Vec::new(), Vec::new()),
        "no memberships of a disabled namespace"
    );

    // 2. Enabled without restarting a pod: the agents query, the members report.
    topology
        .add_manifest("namespaces.yaml", &namespaces(true, true))
        .expect("enable");
    wait_members(&agents[0], "team", group, &["team/pod-0-1"], &["node1"]);
    wait_members(&agents[1], "team", group, &["team/pod-1-0"], &["node0"]);

    // 3. Same node, TTL 1: delivered as on a link, TTL untouched; nothing leaves the node.
    let remote_copies = counter(&agents[0], Hook::FromPod, PacketClass::MulticastRemoteCopy);
    send(&pod(0, 0), group, PORT, 1, 3, "ttl1").expect("send");
    let got = tagged(&near.received(SETTLE), "ttl1");
    assert_eq!(
        got,
        vec![
            ("ttl1-0".into(), 1),
            ("ttl1-1".into(), 1),
            ("ttl1-2".into(), 1)
        ]
    );
    assert!(tagged(&far.received(Duration::ZERO), "ttl1").is_empty());
    assert_eq!(
        counter(&agents[0], Hook::FromPod, PacketClass::MulticastRemoteCopy),
        remote_copies,
        "TTL 1 never leaves the node"
    );

    // 4. Across nodes, TTL 2: one copy per node, arriving routed (TTL 1). On the wire (as
    // tshark decodes it): Geneve with the namespace option, the inner TTL already decremented.
    let wire = Capture::start_for(
        &topology.fabric,
        "n1",
        "udp dst port 6081",
        3,
        5,
        &[
            "ip.dst",
            "ip.ttl",
            "geneve.vni",
            "geneve.option.class",
            "geneve.option.type",
            "geneve.option.length",
            "geneve.option.unknown.data",
        ],
    )
    .expect("capture");
    send(&pod(0, 0), group, PORT, 2, 3, "ttl2").expect("send");
    let id = dataplane_common::multicast::namespace_id(b"team");
    let line = format!("10.99.0.2,224.5.5.5|64,1|0x000001|0xff01|0x01|8,8|{id:08x}");
    assert_eq!(
        wire.finish().expect("tshark"),
        vec![line.clone(), line.clone(), line]
    );
    let far_got = tagged(&far.received(SETTLE), "ttl2");
    assert_eq!(
        far_got,
        vec![
            ("ttl2-0".into(), 1),
            ("ttl2-1".into(), 1),
            ("ttl2-2".into(), 1)
        ]
    );
    assert_eq!(
        tagged(&near.received(Duration::ZERO), "ttl2"),
        vec![
            ("ttl2-0".into(), 2),
            ("ttl2-1".into(), 2),
            ("ttl2-2".into(), 2)
        ]
    );
    assert_eq!(
        counter(&agents[0], Hook::FromPod, PacketClass::MulticastRemoteCopy),
        remote_copies + 3
    );

    // 5. A sender of another (enabled) namespace reaches no member of `team`.
    let no_members = drops(&agents[0], DropReason::MulticastNoMembers);
    send(&pod(0, 2), group, PORT, 2, 3, "other").expect("send");
    assert!(tagged(&near.received(SETTLE), "other").is_empty());
    assert!(tagged(&far.received(Duration::ZERO), "other").is_empty());
    assert_eq!(
        drops(&agents[0], DropReason::MulticastNoMembers),
        no_members + 3
    );

    // 6. Another group: only its member gets it; tshark in the other member's pod sees none.
    let second = Member::join(&pod(1, 1), &["224.3.3.3"], PORT).expect("member");
    wait_members(&agents[0], "team", "224.3.3.3", &[], &["node1"]);
    let capture = Capture::start_for(&pod(0, 1), "eth0", "udp port 5000", 10, 3, &["ip.dst"])
        .expect("capture");
    send(&pod(0, 0), "224.3.3.3", PORT, 2, 3, "second").expect("send");
    assert_eq!(tagged(&second.received(SETTLE), "second").len(), 3);
    assert!(tagged(&near.received(Duration::ZERO), "second").is_empty());
    assert_eq!(capture.finish().expect("tshark"), Vec::<String>::new());
    // `inspect multicast` names the groups, their members here and their member nodes.
    let rows = dataplane_json(topology.node(0), &agents[0], &["inspect", "multicast"]);
    assert_eq!(
        rows,
        serde_json::json!([
            {"namespace": "team", "group": "224.3.3.3", "local_members": [], "member_nodes": ["node1"]},
            {"namespace": "team", "group": "224.5.5.5", "local_members": ["team/pod-0-1"], "member_nodes": ["node1"]},
        ])
    );

    // 6b. The sender's agent restarts (hitless): the new one adopts the pinned memberships,
    // member nodes included, so copies go on at once, before any report or announcement.
    let (pins, run_dir) = agents.remove(0).stop_keeping_pins().expect("stop agent 0");
    agents.insert(
        0,
        topology
            .node(0)
            .start_agent_at_with(pins, run_dir, &["--multicast-query-interval-seconds", "2"])
            .expect("restart agent 0"),
    );
    send(&pod(0, 0), group, PORT, 2, 2, "restarted").expect("send");
    assert_eq!(tagged(&far.received(SETTLE), "restarted").len(), 2);
    assert_eq!(tagged(&near.received(Duration::ZERO), "restarted").len(), 2);

    // 7. Queries: seen by tshark in a pod of an enabled namespace, never in `quiet`.
    let queried = Capture::start_for(&pod(0, 0), "eth0", "igmp", 1, 6, &["igmp.type", "ip.dst"])
        .expect("capture");
    let quiet =
        Capture::start_for(&pod(0, 3), "eth0", "igmp", 1, 6, &["igmp.type"]).expect("capture");
    assert_eq!(queried.finish().expect("tshark"), vec!["0x11|224.0.0.1"]);
    assert_eq!(quiet.finish().expect("tshark"), Vec::<String>::new());

    // 8. A leave stops delivery: node 1's member goes, node 0 stops copying to node 1.
    far.leave();
    wait_members(&agents[1], "team", group, &[], &["node0"]);
    wait_members(&agents[0], "team", group, &["team/pod-0-1"], &[]);
    let remote_copies = counter(&agents[0], Hook::FromPod, PacketClass::MulticastRemoteCopy);
    send(&pod(0, 0), group, PORT, 2, 2, "left").expect("send");
    assert_eq!(tagged(&near.received(SETTLE), "left").len(), 2);
    assert_eq!(
        counter(&agents[0], Hook::FromPod, PacketClass::MulticastRemoteCopy),
        remote_copies
    );

    // 9. Disabled again: nothing more, named.
    topology
        .add_manifest("namespaces.yaml", &namespaces(false, true))
        .expect("disable");
    wait_members(&agents[0], "team", group, &[], &[]);
    let disabled = drops(&agents[0], DropReason::MulticastDisabled);
    send(&pod(0, 0), group, PORT, 1, 2, "off-again").expect("send");
    assert!(tagged(&near.received(SETTLE), "off-again").is_empty());
    assert_eq!(
        drops(&agents[0], DropReason::MulticastDisabled),
        disabled + 2,
        "each datagram of a disabled namespace counted once"
    );
}

#[test]
fn ipv6_multicast_reaches_the_members_of_the_senders_namespace_only() {
    if !privileged("ipv6_multicast_reaches_the_members_of_the_senders_namespace_only") {
        return;
    }
    let (topology, agents) = cluster(true);
    let pod = |node: usize, index: usize| topology.node(node).pods[index].netns.clone();
    let group = "ff0e::5";
    let near = Member::join(&pod(0, 1), &[group], PORT).expect("member");
    let far = Member::join(&pod(1, 0), &[group], PORT).expect("member");
    wait_members(&agents[0], "team", group, &["team/pod-0-1"], &["node1"]);
    wait_members(&agents[1], "team", group, &["team/pod-1-0"], &["node0"]);

    // Hop limit 1 stays on the node.
    send(&pod(0, 0), group, PORT, 1, 3, "hop1").expect("send");
    assert_eq!(
        tagged(&near.received(SETTLE), "hop1"),
        vec![
            ("hop1-0".into(), 1),
            ("hop1-1".into(), 1),
            ("hop1-2".into(), 1)
        ]
    );
    assert!(tagged(&far.received(Duration::ZERO), "hop1").is_empty());

    // Hop limit 2 reaches the other node, one hop used.
    send(&pod(0, 0), group, PORT, 2, 3, "hop2").expect("send");
    assert_eq!(
        tagged(&far.received(SETTLE), "hop2"),
        vec![
            ("hop2-0".into(), 1),
            ("hop2-1".into(), 1),
            ("hop2-2".into(), 1)
        ]
    );
    assert_eq!(tagged(&near.received(Duration::ZERO), "hop2").len(), 3);

    // Another namespace's sender, and a pod of a namespace that never enabled multicast.
    let disabled = drops(&agents[1], DropReason::MulticastDisabled);
    send(&pod(1, 2), group, PORT, 2, 2, "other").expect("send");
    send(&pod(1, 3), group, PORT, 2, 2, "quiet").expect("send");
    // Neither member, on the sender's node or the other, gets either namespace's datagrams.
    let (near_got, far_got) = (near.received(SETTLE), far.received(Duration::ZERO));
    for tag in ["other", "quiet"] {
        assert!(
            tagged(&near_got, tag).is_empty(),
            "{tag} at node 0: {near_got:?}"
        );
        assert!(
            tagged(&far_got, tag).is_empty(),
            "{tag} at node 1: {far_got:?}"
        );
    }
    assert_eq!(
        drops(&agents[1], DropReason::MulticastDisabled),
        disabled + 2,
        "each datagram of the disabled namespace counted once"
    );

    // MLD queries: seen in an enabled namespace's pod, never in `quiet`.
    let queried = Capture::start_for(
        &pod(1, 1),
        "eth0",
        "ip6[6] == 0 and ip6[48] == 130",
        1,
        6,
        &["icmpv6.type", "ipv6.dst", "ipv6.src"],
    )
    .expect("capture");
    let quiet = Capture::start_for(
        &pod(1, 3),
        "eth0",
        "ip6[6] == 0 and ip6[48] == 130",
        1,
        6,
        &["icmpv6.type"],
    )
    .expect("capture");
    assert_eq!(
        queried.finish().expect("tshark"),
        vec!["130|ff02::1|fe80::1"]
    );
    assert_eq!(quiet.finish().expect("tshark"), Vec::<String>::new());
}

#[test]
fn a_node_holds_at_most_2048_groups_and_refuses_more_with_a_count() {
    if !privileged("a_node_holds_at_most_2048_groups_and_refuses_more_with_a_count") {
        return;
    }
    let (topology, agents) = cluster(true);
    let pod = |node: usize, index: usize| topology.node(node).pods[index].netns.clone();
    dataplane_tests::topology::sh_in(&pod(0, 1), "sysctl -qw net.ipv4.igmp_max_memberships=4096")
        .expect("sysctl");
    let groups: Vec<String> = (0..2100)
        .map(|i| format!("239.1.{}.{}", i / 200, i % 200 + 1))
        .collect();
    let names: Vec<&str> = groups.iter().map(String::as_str).collect();
    let member = Member::join(&pod(0, 1), &names, PORT).expect("member");
    let mut held = 0;
    for _ in 0..150 {
        let described = groups_of(&agents[0]);
        held = described["groups"].as_array().map_or(0, Vec::len);
        if held == 2048 && described["refused_joins"].as_u64().unwrap_or(0) >= 52 {
            break;
        }
        thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(held, 2048, "{}", agents[0].log());
    assert!(agents[0].log().contains("multicast join refused"));
    // A refused group's packets are dropped, counted; an admitted one's are delivered. Both
    // picked from one reading of the description.
    let described = groups_of(&agents[0]);
    let held: BTreeSet<&str> = described["groups"]
        .as_array()
        .expect("groups described")
        .iter()
        .filter(|g| g["namespace"] == "team")
        .filter(|g| g["local"].as_array().is_some_and(|l| !l.is_empty()))
        .filter_map(|g| g["group"].as_str())
        .collect();
    let admitted = groups
        .iter()
        .find(|g| held.contains(g.as_str()))
        .expect("an admitted group")
        .clone();
    let refused = groups
        .iter()
        .find(|g| !held.contains(g.as_str()))
        .expect("a refused group")
        .clone();
    let no_members = drops(&agents[0], DropReason::MulticastNoMembers);
    send(&pod(0, 0), &refused, PORT, 1, 2, "refused").expect("send");
    send(&pod(0, 0), &admitted, PORT, 1, 2, "admitted").expect("send");
    let got = member.received(SETTLE);
    assert!(tagged(&got, "refused").is_empty());
    assert_eq!(tagged(&got, "admitted").len(), 2);
    assert_eq!(
        drops(&agents[0], DropReason::MulticastNoMembers),
        no_members + 2
    );
    assert!(agents[0].status_json().is_ok(), "the agent still serves");
}

fn groups_of(agent: &Agent) -> Value {
    groups(agent)
}
