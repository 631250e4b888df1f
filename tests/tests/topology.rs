//! Two simulated nodes with two pods each, the real agent on each node, real traffic.

use aya::maps::{Array, Map, MapData};
use dataplane_common::{
    DropReason, Hook, PacketClass,
    maps::{LAYOUT_VERSION, META},
};
use dataplane_tests::{
    packets,
    privileged::privileged,
    service_bed,
    topology::{Mode, PinsCleanup, Topology, arrival_hook, dataplane_binary, exec_in},
};
use dataplane_user::kernel::stats::Counters;
use std::process::Command;

use serde_json::Value;

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
        delta(&after0, &before0, arrival_hook(), PacketClass::Icmp),
        3
    );
    assert_eq!(
        delta(&after1, &before1, arrival_hook(), PacketClass::Icmp),
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
        delta(&after0, &before0, arrival_hook(), PacketClass::Icmp),
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
    let _cleanup = PinsCleanup(vec![pins.clone()]);
    let link = exec_in(&node0.netns, &["ip", "link", "show", "eth0"]).expect("ip link");
    assert!(
        String::from_utf8_lossy(&link.stdout).contains("xdp"),
        "XDP stays attached after the agent exits"
    );
    assert!(
        pins.map(META).exists(),
        "maps stay pinned for the next agent"
    );
    // XDP and tc on the underlay as pinned links; the pod veths' tc filters stay too.
    let links = pins.link_names();
    assert_eq!(links.len(), 2, "pinned links: {links:?}");
    for pod in &node0.pods {
        for direction in ["ingress", "egress"] {
            let filters = exec_in(
                &node0.netns,
                &["tc", "filter", "show", "dev", &pod.host_iface, direction],
            )
            .expect("tc filter show");
            let program = if direction == "ingress" {
                "tc_from_pod"
            } else {
                "tc_to_pod"
            };
            assert!(
                String::from_utf8_lossy(&filters.stdout).contains(program),
                "{} {direction}: {}",
                pod.host_iface,
                String::from_utf8_lossy(&filters.stdout)
            );
        }
    }
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
        Some(2),
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
        agent0.log().contains("took over the pinned link")
            && agent0.log().contains("took over the tc filter"),
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

/// `GET <path>` on the agent's metrics address inside `netns`.
fn scrape(netns: &str, path: &str) -> String {
    let script = format!(
        "import urllib.request, time\n\
         for attempt in range(50):\n\
         \x20   try:\n\
         \x20       print(urllib.request.urlopen('http://127.0.0.1:9476{path}', timeout=5).read().decode(), end=''); break\n\
         \x20   except OSError: time.sleep(0.1)\n"
    );
    let out = exec_in(netns, &["python3", "-c", &script]).expect("scrape");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The value of the sample `name` (with its labels, as printed) in an exposition.
fn sample(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let value = line.strip_prefix(name)?.strip_prefix(' ')?;
        value.parse().ok()
    })
}

#[test]
fn metrics_report_counters_map_fill_syncs_and_rejected_objects() {
    if !privileged("metrics_report_counters_map_fill_syncs_and_rejected_objects") {
        return;
    }
    let topology = Topology::build_with(2, 1, Mode::Overlay).expect("build topology");
    // One object of each kind that the agent must refuse, by name, while the rest works: a Pod
    // whose spec is not a PodSpec, a second Service on the same address and port, an
    // EgressFirewall with a bad CIDR.
    let bad = "apiVersion: v1\nkind: Pod\nmetadata: {name: broken, namespace: default}\n\
               spec: {containers: 5}\n\
               ---\napiVersion: v1\nkind: Service\nmetadata: {name: one, namespace: default}\n\
               spec: {clusterIP: 10.96.0.50, ports: [{port: 80, protocol: TCP, targetPort: 80}]}\n\
               ---\napiVersion: v1\nkind: Service\nmetadata: {name: two, namespace: default}\n\
               spec: {clusterIP: 10.96.0.50, ports: [{port: 80, protocol: TCP, targetPort: 80}]}\n\
               ---\napiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\n\
               metadata: {name: default, namespace: default}\n\
               spec: {egress: [{type: Deny, to: {cidrSelector: 10.0.0.300/8}}]}\n";
    topology.add_manifest("bad.yaml", bad).expect("manifest");
    let node0 = topology.node(0);
    let agent = node0
        .start_agent_with(&[
            "--metrics-address",
            "127.0.0.1:9476",
            "--log-format",
            "json",
            // Only the directory's inotify events make it look again (within this test).
            "--look-every-seconds",
            "3600",
            "--full-sync-every-seconds",
            "3600",
        ])
        .expect("agent");
    let _peer = topology.node(1).start_agent().expect("agent on node 1");
    let pod = &node0.pods[0];
    assert!(
        pod.ping(topology.node(1).pods[0].ip, 3).unwrap(),
        "cross-node ping"
    );

    let text = scrape(&node0.netns, "/metrics");
    let counters = agent.counters().expect("counters");
    let icmp = format!(
        "dataplane_packets_total{{hook=\"{}\",class=\"{}\"}}",
        Hook::FromPod.name(),
        PacketClass::Icmp.name()
    );
    assert_eq!(
        sample(&text, &icmp),
        Some(counters.packets(Hook::FromPod, PacketClass::Icmp)),
        "{text}"
    );
    assert_eq!(sample(&text, &icmp), Some(3));
    assert_eq!(
        sample(&text, "dataplane_syncs_total{result=\"ok\"}"),
        Some(1)
    );
    assert_eq!(
        sample(&text, "dataplane_sync_duration_seconds_count"),
        Some(1)
    );
    // The first sync is a full one: every stage ran.
    assert_eq!(
        sample(&text, "dataplane_sync_passes_total{kind=\"full\"}"),
        Some(1)
    );
    for stage in ["overlay", "services", "access_control", "egress_ips"] {
        let name = format!("dataplane_sync_stage_runs_total{{stage=\"{stage}\"}}");
        assert_eq!(sample(&text, &name), Some(1), "{name} in {text}");
    }
    for (kind, count) in [
        ("manifest", 1),
        ("service", 1),
        ("egressfirewall", 1),
        ("networkpolicy", 0),
    ] {
        let name = format!("dataplane_rejected_objects{{kind=\"{kind}\"}}");
        assert_eq!(sample(&text, &name), Some(count), "{name} in {text}");
    }
    // Map fill as status reports it: both nodes' tunnel endpoints, one local pod.
    let status = agent.status_json().expect("status");
    for map in status["maps"].as_array().expect("maps") {
        let name = map["name"].as_str().expect("name");
        let capacity = format!("dataplane_map_capacity{{map=\"{name}\"}}");
        assert_eq!(
            sample(&text, &capacity),
            map["max_entries"].as_u64(),
            "{name}"
        );
        if name != "DP_PACKETS" && name != "DP_DROPS" {
            let entries = format!("dataplane_map_entries{{map=\"{name}\"}}");
            assert_eq!(sample(&text, &entries), map["used"].as_u64(), "{name}");
        }
    }
    assert!(text.ends_with("# EOF\n"));
    assert_eq!(scrape(&node0.netns, "/healthz"), "ok\n");
    // Structured logs: one JSON object per line, fields as keys.
    let log = agent.log();
    let events: Vec<Value> = log
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect();
    assert!(
        events
            .iter()
            .any(|e| e["fields"]["message"] == "serving metrics on /metrics"
                && e["fields"]["address"] == "127.0.0.1:9476"
                && e["level"] == "INFO"),
        "{log}"
    );

    // The bad objects go: the next sync rejects nothing.
    topology.remove_manifest("bad.yaml").expect("remove");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let text = loop {
        let text = scrape(&node0.netns, "/metrics");
        if sample(&text, "dataplane_syncs_total{result=\"ok\"}") == Some(2)
            || std::time::Instant::now() > deadline
        {
            break text;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert_eq!(
        sample(&text, "dataplane_syncs_total{result=\"ok\"}"),
        Some(2),
        "{text}"
    );
    for kind in ["manifest", "service", "egressfirewall", "networkpolicy"] {
        let name = format!("dataplane_rejected_objects{{kind=\"{kind}\"}}");
        assert_eq!(sample(&text, &name), Some(0), "{name}");
    }
    // Services and an EgressFirewall went (the broken Pod never parsed): an incremental sync
    // ran the services and access control stages only.
    assert_eq!(
        sample(&text, "dataplane_sync_passes_total{kind=\"incremental\"}"),
        Some(1),
        "{text}"
    );
    for (stage, runs) in [
        ("overlay", 1),
        ("services", 2),
        ("access_control", 2),
        ("egress_ips", 1),
    ] {
        let name = format!("dataplane_sync_stage_runs_total{{stage=\"{stage}\"}}");
        assert_eq!(sample(&text, &name), Some(runs), "{name} in {text}");
    }
    // That sync followed the directory's inotify event (the agent looks by itself only once an
    // hour here): its lag was measured.
    assert!(
        sample(&text, "dataplane_sync_lag_seconds_count").is_some_and(|n| n >= 1),
        "{text}"
    );
}

/// The veth counter `name` (`ethtool -S`) of `iface` in `netns`, summed over its queues.
fn veth_counter(netns: &str, iface: &str, name: &str) -> u64 {
    let out = exec_in(netns, &["ethtool", "-S", iface]).expect("ethtool -S");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.trim().split_once(": "))
        .filter(|(key, _)| key.ends_with(name))
        .map(|(_, value)| value.trim().parse::<u64>().expect("a counter"))
        .sum()
}

#[test]
fn the_xdp_fabric_switches_learned_unicast_port_to_port_with_whole_checksums() {
    if !privileged("the_xdp_fabric_switches_learned_unicast_port_to_port_with_whole_checksums") {
        return;
    }
    let mut topology = Topology::build(2, 1).expect("build topology");
    let external = topology.add_external_host().expect("external host");
    topology.switch_in_xdp().expect("the XDP switch");
    let (pod0, pod1) = (&topology.node(0).pods[0], &topology.node(1).pods[0]);
    let fabric = topology.fabric.clone();
    let redirected = || veth_counter(&fabric, "n0", "xdp_redirect");
    let before = redirected();
    // The first frames (ARP, the first echo) are flooded by the bridge and teach the switch;
    // the rest go from port to port.
    assert!(
        pod0.ping(pod1.ip, 10).expect("ping"),
        "pod to pod across nodes"
    );
    assert!(
        redirected() >= before + 8,
        "node 0's frames were switched in XDP: {} -> {}",
        before,
        redirected()
    );
    // TCP from a pod leaves its checksum to offload; the node completes it before the wire,
    // or the far end would drop every segment.
    let _backend = service_bed::echo_backend(pod1, false).expect("echo backend");
    let answers = service_bed::tcp_answers(&pod0.netns, &pod1.ip.to_string(), 8080, 1)
        .expect("TCP across the switch");
    assert_eq!(answers, vec![format!("{} {}", pod1.ip, pod0.ip)]);
    // The host outside the cluster takes frames from the switch too.
    let node1 = topology.node(1).underlay_ip.to_string();
    let ping = exec_in(
        &external.netns,
        &[
            "ping", "-n", "-q", "-c", "3", "-i", "0.2", "-W", "2", &node1,
        ],
    )
    .expect("ping");
    assert!(ping.status.success(), "external host to node 1");
}

/// The uplink's hook as `--uplink-hook` chooses: `auto` on a veth uplink runs tc alone and
/// says why; an agent that follows one running XDP there takes the XDP program off the uplink
/// (its pinned link removed), and the overlay still carries pods' traffic across nodes with
/// tc unwrapping every Geneve packet; `xdp` after it puts XDP back.
#[test]
fn the_uplink_hook_follows_the_flag_and_auto_picks_tc_on_a_veth() {
    if !privileged("the_uplink_hook_follows_the_flag_and_auto_picks_tc_on_a_veth") {
        return;
    }
    let topology = Topology::build_with(2, 1, Mode::Overlay).expect("build topology");
    let (node0, node1) = (topology.node(0), topology.node(1));
    let uplink = |agent: &dataplane_tests::topology::Agent| -> Vec<(String, String)> {
        let status = agent.status_json().expect("status --json");
        status["state"]["attachments"]
            .as_array()
            .expect("attachments")
            .iter()
            .filter(|a| a["interface"] == "eth0")
            .map(|a| {
                (
                    a["program"].as_str().unwrap_or_default().to_owned(),
                    a["why"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect()
    };
    let xdp_on_eth0 = || {
        let link = exec_in(&node0.netns, &["ip", "link", "show", "eth0"]).expect("ip link");
        String::from_utf8_lossy(&link.stdout).contains("xdp")
    };

    let agent0 = node0
        .start_agent_with(&["--uplink-hook", "xdp"])
        .expect("agent on node 0");
    let agent1 = node1
        .start_agent_with(&["--uplink-hook", "tc"])
        .expect("agent on node 1");
    assert!(xdp_on_eth0(), "--uplink-hook xdp attaches XDP");
    let programs: Vec<String> = uplink(&agent0).into_iter().map(|(p, _)| p).collect();
    assert_eq!(programs, ["xdp_underlay", "tc_underlay"]);
    let (pins, run_dir) = agent0.stop_keeping_pins().expect("stop agent 0");

    // The next agent, on auto: a veth uplink runs tc alone.
    let agent0 = node0
        .start_agent_at_with(pins, run_dir, &["--uplink-hook", "auto"])
        .expect("agent on node 0 again");
    let attached = uplink(&agent0);
    assert_eq!(attached.len(), 1, "{attached:?}");
    assert_eq!(attached[0].0, "tc_underlay");
    assert!(
        attached[0]
            .1
            .starts_with("uplink hook tc: --uplink-hook auto: driver veth"),
        "{attached:?}"
    );
    assert!(!xdp_on_eth0(), "the previous agent's XDP link removed");

    // Both ways through Geneve unwrapped at tc: counted there, none by XDP.
    let (before0, before1) = (agent0.counters().unwrap(), agent1.counters().unwrap());
    assert!(
        node0.pods[0].ping(node1.pods[0].ip, 3).unwrap(),
        "cross-node ping with both uplinks on tc\nagent 0:\n{}\nagent 1:\n{}",
        agent0.log(),
        agent1.log()
    );
    let (after0, after1) = (agent0.counters().unwrap(), agent1.counters().unwrap());
    for (after, before) in [(&after0, &before0), (&after1, &before1)] {
        assert_eq!(
            delta(after, before, Hook::UnderlayTc, PacketClass::GeneveDecap),
            3
        );
        assert_eq!(delta(after, before, Hook::Underlay, PacketClass::Total), 0);
    }
    let (pins, run_dir) = agent0.stop_keeping_pins().expect("stop agent 0 again");
    let agent0 = node0
        .start_agent_at_with(pins, run_dir, &["--uplink-hook", "xdp"])
        .expect("agent on node 0 a third time");
    assert!(xdp_on_eth0(), "XDP back with --uplink-hook xdp");
    assert!(node0.pods[0].ping(node1.pods[0].ip, 2).unwrap());
    drop(agent0);
}
