//! EgressFirewall packet tests through the real `tc_from_pod` with BPF_PROG_TEST_RUN: the
//! agent's compile and sync fill the maps, frames from pods are judged, and verdicts, counters
//! and map contents are checked exactly. Updates switch whole, a rejected object keeps the last
//! good rules, and a restarted agent adopts what the pins hold.

use std::net::IpAddr;

use aya::maps::{Array, HashMap, Map, MapData, RingBuf};
use dataplane_common::{
    DropReason, Hook, PacketClass,
    acl::{
        ACL_DIRECTION_EGRESS, ACL_ENDPOINT_EGRESS_PEERS, ACL_ENTRY_FINAL, ACL_ENTRY_PORTS,
        ACL_KIND_FIREWALL, ACL_LOG_ALLOW, ACL_LOG_DENY, ACL_PORT_EXACT, ACL_RULE_DEFAULT,
        ACL_VERDICT_ALLOW, ACL_VERDICT_DENY, ACL_VERDICT_NONE, AclAddrKey, AclAddrValue,
        AclEndpoint, AclEvent, AclLengths, AclPortKey, AclVerdict, peer_key,
    },
    maps::{ACL_ACTIVE, ACL_ADDRS, ACL_ENDPOINTS, ACL_EVENTS, ACL_PEERS, ACL_PORTS, PROG_FROM_POD},
    overlay::Addr,
};
use dataplane_tests::{
    fixture::Fixture,
    packets::{icmp_v4_echo, sctp_v4_flow, tcp_v4_flow, tcp_v6_flow, udp_v4_flow},
    privileged::privileged,
};
use dataplane_user::{
    AgentError,
    acl::{
        AclPod, AclState, DesiredFirewalls,
        explain::PolicyMaps,
        firewall::{DnsAddresses, FirewallContext, compile_firewalls},
        pods::Direction,
    },
    api::egressfirewall::EgressFirewall,
    kernel::capacity::Capacities,
    mapsync::addr16,
};

const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;

const TEAM_POD: [u8; 4] = [10, 244, 1, 9];
const TEAM_POD6: [u8; 16] = [0xfd, 0, 0, 0x10, 0x02, 0x44, 0, 1, 0, 0, 0, 0, 0, 0, 0, 9];
const OTHER_POD: [u8; 4] = [10, 244, 1, 10];

fn pods() -> Vec<AclPod> {
    vec![
        AclPod {
            namespace: "team".into(),
            name: "pod".into(),
            addresses: vec![IpAddr::from(TEAM_POD), IpAddr::from(TEAM_POD6)],
        },
        AclPod {
            namespace: "other".into(),
            name: "pod".into(),
            addresses: vec![IpAddr::from(OTHER_POD)],
        },
    ]
}

fn context() -> FirewallContext {
    FirewallContext {
        exempt: ["10.244.0.0/16", "10.96.0.0/16", "fd00:10:244::/48"]
            .iter()
            .map(|n| n.parse().expect("CIDR"))
            .collect(),
        node_addresses: vec!["10.99.0.1".parse().expect("address")],
    }
}

/// The firewalls of `yaml` (EgressFirewall documents), compiled for this node.
fn desired(yaml: &str) -> DesiredFirewalls {
    desired_with(yaml, &DnsAddresses::new())
}

/// As [`desired`], with DNS names resolved to `dns`.
fn desired_with(yaml: &str, dns: &DnsAddresses) -> DesiredFirewalls {
    let objects: Vec<std::sync::Arc<EgressFirewall>> = serde_yaml::Deserializer::from_str(yaml)
        .map(|d| std::sync::Arc::new(serde::Deserialize::deserialize(d).expect("EgressFirewall")))
        .collect();
    compile_firewalls(&objects, &context(), dns).desired
}

const TEAM_FIREWALL: &str = "\
apiVersion: k8s.ovn.org/v1
kind: EgressFirewall
metadata: {name: default, namespace: team}
spec:
  egress:
  - {type: Allow, to: {cidrSelector: 192.0.2.0/24}, ports: [{protocol: TCP, port: 443}]}
  - {type: Deny, to: {cidrSelector: 192.0.2.0/24}}
  - {type: Allow, to: {cidrSelector: 198.51.100.7/32}, ports: [{protocol: UDP}]}
  - {type: Allow, to: {cidrSelector: \"2001:db8::/32\"}}
  - {type: Deny, to: {cidrSelector: 0.0.0.0/0}}
  - {type: Deny, to: {cidrSelector: \"::/0\"}}
";

fn verdict(fixture: &mut Fixture, frame: &[u8]) -> u32 {
    fixture.port_as_sender_of(frame).expect("port");
    let out = fixture.run_tc(PROG_FROM_POD, frame, 1).expect("tc run");
    if out.action == TC_ACT_OK {
        assert_eq!(out.output, frame, "an allowed packet is not changed");
    }
    out.action
}

fn v6(text: &str) -> [u8; 16] {
    text.parse::<std::net::Ipv6Addr>().expect("IPv6").octets()
}

fn endpoint_sets(fixture: &mut Fixture) -> Vec<(Addr, u32)> {
    let map: HashMap<&mut MapData, Addr, AclEndpoint> =
        fixture.typed_map(ACL_ENDPOINTS).expect("endpoints map");
    let mut entries: Vec<(Addr, u32)> = map
        .iter()
        .filter_map(Result::ok)
        .map(|(k, v)| (k, v.firewall))
        .collect();
    entries.sort();
    entries
}

/// Set ids present in the address trie, and the number of port trie entries.
fn installed(fixture: &mut Fixture) -> (Vec<u32>, usize) {
    let addrs: HashMap<&mut MapData, AclAddrKey, AclAddrValue> =
        fixture.typed_map(ACL_ADDRS).expect("addrs map");
    let mut sets: Vec<u32> = addrs.keys().filter_map(Result::ok).map(|k| k.set).collect();
    sets.sort();
    sets.dedup();
    let ports: HashMap<&mut MapData, AclPortKey, AclVerdict> =
        fixture.typed_map(ACL_PORTS).expect("ports map");
    (sets, ports.keys().filter_map(Result::ok).count())
}

/// How many port trie entries the team's compiled tables take.
fn port_entries(wanted: &DesiredFirewalls) -> usize {
    wanted.sets["team"]
        .tables
        .iter()
        .map(|table| table.entries())
        .sum()
}

#[test]
fn egress_firewall_verdicts_follow_the_first_matching_rule() {
    if !privileged("egress_firewall_verdicts_follow_the_first_matching_rule") {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = AclState::default();
    let wanted = desired(TEAM_FIREWALL);
    let stats = fixture
        .sync_acl(&mut state, &wanted, &pods())
        .expect("sync");
    assert_eq!(stats.sets, 1);
    let set = state.firewall_set("team").expect("team has a firewall");
    // Only the team's pod addresses point at a firewall.
    assert_eq!(
        endpoint_sets(&mut fixture),
        vec![(addr16(IpAddr::from(TEAM_POD)), set), (TEAM_POD6, set)]
    );
    assert_eq!(installed(&mut fixture), (vec![set], port_entries(&wanted)));

    let web = [192, 0, 2, 5];
    let cases: Vec<(&str, Vec<u8>, u32)> = vec![
        (
            "rule 0: TCP 443",
            tcp_v4_flow(TEAM_POD, 40000, web, 443, true),
            TC_ACT_OK,
        ),
        (
            "rule 1: TCP 80",
            tcp_v4_flow(TEAM_POD, 40000, web, 80, true),
            TC_ACT_SHOT,
        ),
        (
            "rule 1: UDP 443",
            udp_v4_flow(TEAM_POD, 40000, web, 443),
            TC_ACT_SHOT,
        ),
        ("rule 1: ICMP", icmp_v4_echo(TEAM_POD, web), TC_ACT_SHOT),
        (
            "rule 2: UDP any port",
            udp_v4_flow(TEAM_POD, 40000, [198, 51, 100, 7], 9999),
            TC_ACT_OK,
        ),
        (
            "rule 4: TCP to that host",
            tcp_v4_flow(TEAM_POD, 40000, [198, 51, 100, 7], 80, true),
            TC_ACT_SHOT,
        ),
        (
            "rule 4: SCTP",
            sctp_v4_flow(TEAM_POD, [203, 0, 113, 1], 38412),
            TC_ACT_SHOT,
        ),
        (
            "rule 4: UDP 53 elsewhere",
            udp_v4_flow(TEAM_POD, 40000, [8, 8, 8, 8], 53),
            TC_ACT_SHOT,
        ),
        (
            "exempt: node DNS",
            udp_v4_flow(TEAM_POD, 40000, [10, 99, 0, 1], 53),
            TC_ACT_OK,
        ),
        (
            "rule 4: node SSH",
            tcp_v4_flow(TEAM_POD, 40000, [10, 99, 0, 1], 22, true),
            TC_ACT_SHOT,
        ),
        (
            "exempt: pod network",
            tcp_v4_flow(TEAM_POD, 40000, [10, 244, 2, 5], 80, true),
            TC_ACT_OK,
        ),
        (
            "exempt: service network",
            udp_v4_flow(TEAM_POD, 40000, [10, 96, 0, 10], 53),
            TC_ACT_OK,
        ),
        (
            "rule 3: IPv6",
            tcp_v6_flow(TEAM_POD6, 40000, v6("2001:db8::1"), 443),
            TC_ACT_OK,
        ),
        (
            "rule 5: IPv6",
            tcp_v6_flow(TEAM_POD6, 40000, v6("2001:4860::8888"), 443),
            TC_ACT_SHOT,
        ),
        (
            "exempt: IPv6 pod network",
            tcp_v6_flow(TEAM_POD6, 40000, v6("fd00:10:244:2::5"), 80),
            TC_ACT_OK,
        ),
        (
            "other namespace: no firewall",
            udp_v4_flow(OTHER_POD, 40000, [8, 8, 8, 8], 53),
            TC_ACT_OK,
        ),
    ];
    let mut allowed = 0;
    let mut denied = 0;
    for (name, frame, expected) in &cases {
        assert_eq!(verdict(&mut fixture, frame), *expected, "{name}");
        if *expected == TC_ACT_SHOT {
            denied += 1;
        } else if !name.starts_with("other") {
            allowed += 1;
        }
    }
    let counters = fixture.counters();
    assert_eq!(counters.drops(DropReason::FirewallDenied), denied);
    assert_eq!(
        counters.packets(Hook::FromPod, PacketClass::FirewallAllowed),
        allowed
    );
}

#[test]
fn updates_switch_whole_and_a_rejected_object_keeps_the_last_good_rules() {
    if !privileged("updates_switch_whole_and_a_rejected_object_keeps_the_last_good_rules") {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = AclState::default();
    let to_web = tcp_v4_flow(TEAM_POD, 40000, [192, 0, 2, 5], 80, true);
    let deny_all = "apiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\n\
                    metadata: {name: default, namespace: team}\n\
                    spec: {egress: [{type: Deny, to: {cidrSelector: 0.0.0.0/0}}]}\n";
    let allow_web = "apiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\n\
                     metadata: {name: default, namespace: team}\n\
                     spec: {egress: [{type: Allow, to: {cidrSelector: 192.0.2.0/24}, ports: [{protocol: TCP, port: 80}]}, \
                     {type: Deny, to: {cidrSelector: 0.0.0.0/0}}]}\n";
    let invalid = "apiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\n\
                   metadata: {name: default, namespace: team}\n\
                   spec: {egress: [{type: Allow, to: {cidrSelector: 192.0.2.0/33}}]}\n";

    fixture
        .sync_acl(&mut state, &desired(deny_all), &pods())
        .expect("sync");
    let first = state.firewall_set("team").expect("set");
    assert_eq!(verdict(&mut fixture, &to_web), TC_ACT_SHOT);

    // The invalid object is rejected whole: the deny-all set stays, nothing is written.
    let rejected = desired(invalid);
    assert!(rejected.rejected.contains("team") && rejected.sets.is_empty());
    let stats = fixture
        .sync_acl(&mut state, &rejected, &pods())
        .expect("sync");
    assert_eq!((stats.written, stats.deleted), (0, 0));
    assert_eq!(state.firewall_set("team"), Some(first));
    assert_eq!(verdict(&mut fixture, &to_web), TC_ACT_SHOT);

    // A valid change goes in under a new set; the old one is gone afterwards.
    fixture
        .sync_acl(&mut state, &desired(allow_web), &pods())
        .expect("sync");
    let second = state.firewall_set("team").expect("set");
    assert_ne!(second, first);
    assert_eq!(installed(&mut fixture).0, vec![second]);
    assert_eq!(verdict(&mut fixture, &to_web), TC_ACT_OK);
    let to_ssh = tcp_v4_flow(TEAM_POD, 40000, [192, 0, 2, 5], 22, true);
    assert_eq!(verdict(&mut fixture, &to_ssh), TC_ACT_SHOT);

    // The same rules again: nothing to write.
    let stats = fixture
        .sync_acl(&mut state, &desired(allow_web), &pods())
        .expect("sync");
    assert_eq!((stats.written, stats.deleted), (0, 0));

    // A restarted agent adopts the pins: a now-invalid object keeps the rules in force.
    let mut restarted = AclState::default();
    fixture.adopt_acl(&mut restarted, &pods()).expect("adopt");
    assert_eq!(restarted.firewall_set("team"), Some(second));
    fixture
        .sync_acl(&mut restarted, &desired(invalid), &pods())
        .expect("sync");
    assert_eq!(verdict(&mut fixture, &to_web), TC_ACT_OK);
    assert_eq!(installed(&mut fixture).0, vec![second]);

    // Then a valid object replaces the adopted set, and removing it clears every map.
    fixture
        .sync_acl(&mut restarted, &desired(deny_all), &pods())
        .expect("sync");
    let third = restarted.firewall_set("team").expect("set");
    assert!(third > second, "fresh ids after adoption");
    assert_eq!(
        installed(&mut fixture),
        (vec![third], port_entries(&desired(deny_all)))
    );
    assert_eq!(verdict(&mut fixture, &to_web), TC_ACT_SHOT);
    fixture
        .sync_acl(&mut restarted, &DesiredFirewalls::default(), &pods())
        .expect("sync");
    assert_eq!(installed(&mut fixture), (vec![], 0));
    assert!(endpoint_sets(&mut fixture).is_empty());
    assert_eq!(verdict(&mut fixture, &to_web), TC_ACT_OK);
}

#[test]
fn a_dns_name_with_new_addresses_changes_only_its_own_entries_in_place() {
    if !privileged("a_dns_name_with_new_addresses_changes_only_its_own_entries_in_place") {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = AclState::default();
    let yaml = "apiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\n\
                metadata: {name: default, namespace: team}\n\
                spec: {egress: [{type: Allow, to: {dnsName: www.example.com}, ports: [{protocol: TCP, port: 443}]}, \
                {type: Allow, to: {cidrSelector: 198.51.100.0/24}}, \
                {type: Deny, to: {cidrSelector: 0.0.0.0/0}}]}\n";
    let first = desired_with(yaml, &www_resolved_to(&["192.0.2.10", "192.0.2.11"]));
    fixture.sync_acl(&mut state, &first, &pods()).expect("sync");
    let set = state.firewall_set("team").expect("set");
    let https = |last: u8| tcp_v4_flow(TEAM_POD, 40000, [192, 0, 2, last], 443, true);
    assert_eq!(verdict(&mut fixture, &https(10)), TC_ACT_OK);
    assert_eq!(verdict(&mut fixture, &https(11)), TC_ACT_OK);
    assert_eq!(verdict(&mut fixture, &https(12)), TC_ACT_SHOT);
    let (_, ports_before) = installed(&mut fixture);

    // .11 goes, .12 comes: one prefix written, one removed, the port table shared and kept.
    let second = desired_with(yaml, &www_resolved_to(&["192.0.2.10", "192.0.2.12"]));
    let stats = fixture
        .update_acl_in_place(&mut state, "team", &second.sets["team"])
        .expect("update")
        .expect("in place");
    assert_eq!((stats.written, stats.deleted), (1, 1));
    assert_eq!(state.firewall_set("team"), Some(set), "same set, no switch");
    assert_eq!(installed(&mut fixture), (vec![set], ports_before));
    assert_eq!(verdict(&mut fixture, &https(10)), TC_ACT_OK);
    assert_eq!(verdict(&mut fixture, &https(11)), TC_ACT_SHOT);
    assert_eq!(verdict(&mut fixture, &https(12)), TC_ACT_OK);
    // The CIDR rule is untouched.
    let web = tcp_v4_flow(TEAM_POD, 40000, [198, 51, 100, 1], 80, true);
    assert_eq!(verdict(&mut fixture, &web), TC_ACT_OK);

    // Another name's worth of change compiled from scratch equals what the maps now hold: a
    // fresh agent syncing `second` writes nothing new for the team.
    let unchanged = fixture
        .update_acl_in_place(&mut state, "team", &second.sets["team"])
        .expect("update")
        .expect("in place");
    assert_eq!((unchanged.written, unchanged.deleted), (0, 0));
}

/// `www.example.com` resolved to `addresses`.
fn www_resolved_to(addresses: &[&str]) -> DnsAddresses {
    [(
        "www.example.com".to_owned(),
        addresses
            .iter()
            .map(|a| a.parse().expect("address"))
            .collect(),
    )]
    .into()
}

/// Deletes set `set`'s entry for the host `address` from the address map, as a sync that
/// stopped midway may have.
fn delete_host_entry(fixture: &mut Fixture, set: u32, address: &str) {
    let mut addrs: HashMap<&mut MapData, AclAddrKey, AclAddrValue> =
        fixture.typed_map(ACL_ADDRS).expect("addrs map");
    let wanted = addr16(address.parse().expect("address"));
    let key = addrs
        .keys()
        .filter_map(Result::ok)
        .find(|key| key.set == set && key.addr == wanted)
        .expect("the host's entry");
    addrs.remove(&key).expect("delete");
}

#[test]
fn an_entry_gone_already_does_not_stop_an_update_or_a_removal() {
    if !privileged("an_entry_gone_already_does_not_stop_an_update_or_a_removal") {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = AclState::default();
    let yaml = "apiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\n\
                metadata: {name: default, namespace: team}\n\
                spec: {egress: [{type: Allow, to: {dnsName: www.example.com}, ports: [{protocol: TCP, port: 443}]}, \
                {type: Deny, to: {cidrSelector: 0.0.0.0/0}}]}\n";
    let first = desired_with(yaml, &www_resolved_to(&["192.0.2.10", "192.0.2.11"]));
    fixture.sync_acl(&mut state, &first, &pods()).expect("sync");
    let set = state.firewall_set("team").expect("set");
    let https = |last: u8| tcp_v4_flow(TEAM_POD, 40000, [192, 0, 2, last], 443, true);

    // .11 is gone from the map before the update that takes it out: the update goes on.
    delete_host_entry(&mut fixture, set, "192.0.2.11");
    let second = desired_with(yaml, &www_resolved_to(&["192.0.2.10", "192.0.2.12"]));
    let stats = fixture
        .update_acl_in_place(&mut state, "team", &second.sets["team"])
        .expect("an entry already gone is not an error")
        .expect("in place");
    assert_eq!((stats.written, stats.deleted), (1, 0));
    assert_eq!(verdict(&mut fixture, &https(10)), TC_ACT_OK);
    assert_eq!(verdict(&mut fixture, &https(11)), TC_ACT_SHOT);
    assert_eq!(verdict(&mut fixture, &https(12)), TC_ACT_OK);

    // .12 is gone before the set is removed: the batch goes on past it and every other
    // entry of the set goes.
    delete_host_entry(&mut fixture, set, "192.0.2.12");
    let (sets, ports) = installed(&mut fixture);
    assert_eq!(sets, vec![set]);
    assert!(ports > 0);
    let prefixes = {
        let addrs: HashMap<&mut MapData, AclAddrKey, AclAddrValue> =
            fixture.typed_map(ACL_ADDRS).expect("addrs map");
        addrs.keys().filter_map(Result::ok).count()
    };
    let endpoints = endpoint_sets(&mut fixture).len();
    assert!(endpoints > 0);
    let stats = fixture
        .sync_acl(&mut state, &DesiredFirewalls::default(), &pods())
        .expect("a removal past an entry already gone");
    assert_eq!(installed(&mut fixture), (vec![], 0));
    assert!(endpoint_sets(&mut fixture).is_empty());
    assert_eq!(state.firewall_set("team"), None);
    // Each entry still there deleted once, the missing one not counted.
    assert_eq!(stats.deleted, prefixes + ports + endpoints);
}

/// How many entries the address map holds.
fn prefix_entries(fixture: &mut Fixture) -> usize {
    let addrs: HashMap<&mut MapData, AclAddrKey, AclAddrValue> =
        fixture.typed_map(ACL_ADDRS).expect("addrs map");
    addrs.keys().filter_map(Result::ok).count()
}

/// A set id no sync hands out soon: entries that take room from the agent's sets.
const FILLER_SET: u32 = u32::MAX - 1;

/// Writes `count` entries of [`FILLER_SET`] (`remove`: takes them out again).
fn filler_entries(fixture: &mut Fixture, count: usize, remove: bool) {
    let mut addrs: HashMap<&mut MapData, AclAddrKey, AclAddrValue> =
        fixture.typed_map(ACL_ADDRS).expect("addrs map");
    for index in 0..count {
        let key = AclAddrKey {
            set: FILLER_SET,
            family: 4,
            len: 32,
            addr: addr16(IpAddr::from([198, 51, 100, index as u8])),
            ..AclAddrKey::default()
        };
        if remove {
            addrs.remove(&key).expect("remove a filler entry");
        } else {
            addrs
                .insert(key, AclAddrValue::default(), 0)
                .expect("room for a filler entry");
        }
    }
}

/// An in-place update that stopped midway (the address map filled up after the first of two
/// new addresses) has written that address under a set whose record is still the old rules.
/// Were the record kept, the old rules coming back would find themselves in force and leave
/// the address let through. The set is no longer changed in place; the next sync replaces it
/// whole, and every key either version wrote goes with it.
#[test]
fn an_update_stopped_midway_is_replaced_whole_when_the_old_rules_come_back() {
    if !privileged("an_update_stopped_midway_is_replaced_whole_when_the_old_rules_come_back") {
        return;
    }
    const CAPACITY: usize = 32;
    let capacities = Capacities {
        acl_entries: CAPACITY as u32,
        ..Capacities::default()
    };
    let mut fixture = Fixture::load_with(&capacities).expect("programs load");
    let mut state = AclState::default();
    let yaml = "apiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\n\
                metadata: {name: default, namespace: team}\n\
                spec: {egress: [{type: Allow, to: {dnsName: www.example.com}, ports: [{protocol: TCP, port: 443}]}, \
                {type: Deny, to: {cidrSelector: 0.0.0.0/0}}]}\n";
    let first = desired_with(yaml, &www_resolved_to(&["192.0.2.10"]));
    fixture.sync_acl(&mut state, &first, &pods()).expect("sync");
    let set = state.firewall_set("team").expect("set");
    let https = |last: u8| tcp_v4_flow(TEAM_POD, 40000, [192, 0, 2, last], 443, true);
    let held = prefix_entries(&mut fixture);
    assert!(2 * held < CAPACITY, "{held} entries: room for a second set");

    // Room for one entry more: .11 is written, .12 is not.
    let fillers = CAPACITY - held - 1;
    filler_entries(&mut fixture, fillers, false);
    let grown = desired_with(
        yaml,
        &www_resolved_to(&["192.0.2.10", "192.0.2.11", "192.0.2.12"]),
    );
    let error = fixture
        .update_acl_in_place(&mut state, "team", &grown.sets["team"])
        .expect_err("the second new address does not fit");
    assert!(
        matches!(&error, AgentError::MapFull { name, .. } if name == ACL_ADDRS),
        "{error}"
    );
    assert_eq!(prefix_entries(&mut fixture), CAPACITY);
    assert_eq!(verdict(&mut fixture, &https(11)), TC_ACT_OK, "written");
    assert_eq!(
        verdict(&mut fixture, &https(12)),
        TC_ACT_SHOT,
        "not written"
    );

    // Its rules unknown, the set is not changed in place any more (nothing written).
    assert!(
        fixture
            .update_acl_in_place(&mut state, "team", &first.sets["team"])
            .expect("no write tried")
            .is_none()
    );
    filler_entries(&mut fixture, fillers, true);
    // The old rules again: a new set, and the half-updated one goes whole.
    fixture
        .sync_acl(&mut state, &first, &pods())
        .expect("sync the old rules");
    let new_set = state.firewall_set("team").expect("set");
    assert_ne!(new_set, set);
    assert_eq!(installed(&mut fixture).0, vec![new_set]);
    assert_eq!(prefix_entries(&mut fixture), held);
    assert_eq!(verdict(&mut fixture, &https(10)), TC_ACT_OK);
    assert_eq!(
        verdict(&mut fixture, &https(11)),
        TC_ACT_SHOT,
        "gone with the set"
    );
    assert_eq!(verdict(&mut fixture, &https(12)), TC_ACT_SHOT);
}

/// A policy set that names peers by identity: where no prefix entry allows a packet, the
/// peer's identity (`ACL_PEERS`) and the set's entry for it (`peer_key`) decide, port table
/// included; every address of the identity shares the one entry; a peer without identity,
/// or of an identity the set has no entry for, is denied; and without the endpoint's flag
/// the identities are not looked at. `inspect`'s replay of the lookups agrees.
#[test]
fn a_policy_set_allows_the_peers_of_an_identity_through_one_entry() {
    if !privileged("a_policy_set_allows_the_peers_of_an_identity_through_one_entry") {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    const SET: u32 = 77;
    const TABLE: u32 = 78;
    const WEB: u32 = 9;
    const DB: u32 = 10;
    let peer = |last: u8| [203, 0, 113, last];
    let mut lengths = AclLengths::default();
    lengths.v4[0] = 32;
    {
        let mut addrs: HashMap<&mut MapData, AclAddrKey, AclAddrValue> =
            fixture.typed_map(ACL_ADDRS).expect("addrs map");
        // 203.0.113.5 allowed by an ipBlock (a prefix entry, every port).
        let host = AclAddrKey {
            set: SET,
            family: 4,
            len: 32,
            addr: addr16(IpAddr::from(peer(5))),
            ..AclAddrKey::default()
        };
        let allowed = AclAddrValue {
            rule: 0,
            verdict: ACL_VERDICT_ALLOW,
            kind: ACL_ENTRY_FINAL,
            ..AclAddrValue::default()
        };
        addrs.insert(host, allowed, 0).expect("prefix entry");
        // Identity WEB's pods take TCP 8080 only (rule 1).
        let by_port = AclAddrValue {
            table: TABLE,
            rule: ACL_RULE_DEFAULT,
            verdict: ACL_VERDICT_NONE,
            kind: ACL_ENTRY_PORTS,
            port_kinds: ACL_PORT_EXACT,
            ..AclAddrValue::default()
        };
        addrs
            .insert(peer_key(SET, WEB), by_port, 0)
            .expect("peer entry");
    }
    {
        let mut ports: HashMap<&mut MapData, AclPortKey, AclVerdict> =
            fixture.typed_map(ACL_PORTS).expect("ports map");
        let key = AclPortKey {
            table: TABLE,
            protocol: 6,
            kind: ACL_PORT_EXACT,
            port: 8080,
        };
        let verdict = AclVerdict {
            rule: 1,
            verdict: ACL_VERDICT_ALLOW,
            ..AclVerdict::default()
        };
        ports.insert(key, verdict, 0).expect("port entry");
    }
    {
        let mut peers: HashMap<&mut MapData, [u8; 16], u32> =
            fixture.typed_map(ACL_PEERS).expect("peers map");
        for (last, identity) in [(7, WEB), (8, WEB), (9, DB)] {
            peers
                .insert(addr16(IpAddr::from(peer(last))), identity, 0)
                .expect("peer address");
        }
    }
    let set_endpoint = |fixture: &mut Fixture, flags: u8| {
        let endpoint = AclEndpoint {
            egress: SET,
            egress_lengths: lengths,
            flags,
            ..AclEndpoint::default()
        };
        let mut endpoints: HashMap<&mut MapData, Addr, AclEndpoint> =
            fixture.typed_map(ACL_ENDPOINTS).expect("endpoints map");
        endpoints
            .insert(addr16(IpAddr::from(TEAM_POD)), endpoint, 0)
            .expect("endpoint");
    };
    set_endpoint(&mut fixture, ACL_ENDPOINT_EGRESS_PEERS);
    let mut active: Array<&mut MapData, u32> = fixture.typed_map(ACL_ACTIVE).expect("active");
    active.set(0, 1, 0).expect("active");

    // A new source port each: an allowed flow is tracked, and its next packet would pass as
    // one.
    let mut source_port = 40000;
    let mut send = |fixture: &mut Fixture, last: u8, port: u16| {
        source_port += 1;
        verdict(
            fixture,
            &tcp_v4_flow(TEAM_POD, source_port, peer(last), port, true),
        )
    };
    assert_eq!(send(&mut fixture, 5, 80), TC_ACT_OK, "the prefix entry");
    assert_eq!(send(&mut fixture, 7, 8080), TC_ACT_OK, "WEB's entry");
    assert_eq!(send(&mut fixture, 8, 8080), TC_ACT_OK, "WEB's entry again");
    assert_eq!(send(&mut fixture, 7, 80), TC_ACT_SHOT, "not WEB's port");
    assert_eq!(send(&mut fixture, 9, 8080), TC_ACT_SHOT, "DB: no entry");
    assert_eq!(send(&mut fixture, 10, 8080), TC_ACT_SHOT, "no identity");

    let maps = PolicyMaps::open(fixture.pins()).expect("pinned maps");
    let decide = |last: u8, port: u16| {
        let decided = maps
            .decide(
                IpAddr::from(TEAM_POD),
                Direction::Egress,
                IpAddr::from(peer(last)),
                6,
                port,
            )
            .expect("an egress set");
        (decided.set, decided.verdict, decided.rule)
    };
    assert_eq!(decide(5, 80), (SET, ACL_VERDICT_ALLOW, 0));
    assert_eq!(decide(8, 8080), (SET, ACL_VERDICT_ALLOW, 1));
    assert_eq!(decide(7, 80), (SET, ACL_VERDICT_NONE, ACL_RULE_DEFAULT));
    assert_eq!(decide(10, 8080), (SET, ACL_VERDICT_NONE, ACL_RULE_DEFAULT));

    // Without the flag, the set has no peer entries as far as the kernel looks.
    set_endpoint(&mut fixture, 0);
    assert_eq!(send(&mut fixture, 7, 8080), TC_ACT_SHOT);
    assert_eq!(send(&mut fixture, 5, 80), TC_ACT_OK);
    let maps = PolicyMaps::open(fixture.pins()).expect("pinned maps");
    let decided = maps
        .decide(
            IpAddr::from(TEAM_POD),
            Direction::Egress,
            IpAddr::from(peer(7)),
            6,
            8080,
        )
        .expect("an egress set");
    assert_eq!(decided.verdict, ACL_VERDICT_NONE);
}

/// Every audit record waiting in the fixture's ring buffer.
fn audit_events(fixture: &Fixture) -> Vec<AclEvent> {
    let pin = fixture.pins().map(ACL_EVENTS);
    let data = MapData::from_pin(&pin).expect("ring buffer pin");
    let mut ring = RingBuf::try_from(Map::RingBuf(data)).expect("ring buffer");
    let mut events = Vec::new();
    while let Some(item) = ring.next() {
        assert_eq!(item.len(), std::mem::size_of::<AclEvent>());
        // SAFETY: the kernel wrote an AclEvent (plain data) of exactly this size.
        events.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<AclEvent>()) });
    }
    events
}

#[test]
fn audited_namespaces_send_one_record_per_denied_packet_and_allowed_connection() {
    if !privileged("audited_namespaces_send_one_record_per_denied_packet_and_allowed_connection") {
        return;
    }
    let mut fixture = Fixture::load().expect("programs load");
    let mut state = AclState::default();
    let mut wanted = desired(TEAM_FIREWALL);
    wanted
        .log
        .insert("team".into(), ACL_LOG_ALLOW | ACL_LOG_DENY);
    fixture.set_audit_rate(1000).expect("rate");
    fixture
        .sync_acl(&mut state, &wanted, &pods())
        .expect("sync");
    let set = state.firewall_set("team").expect("set");
    let web = [192, 0, 2, 5];
    let syn = tcp_v4_flow(TEAM_POD, 40000, web, 443, true);
    let ack = tcp_v4_flow(TEAM_POD, 40000, web, 443, false);
    let denied = tcp_v4_flow(TEAM_POD, 40001, web, 80, true);
    let cluster = tcp_v4_flow(TEAM_POD, 40002, [10, 244, 2, 5], 80, true);
    let unmatched = tcp_v6_flow(TEAM_POD6, 40003, v6("2001:db8::1"), 22);
    assert_eq!(verdict(&mut fixture, &syn), TC_ACT_OK);
    assert_eq!(verdict(&mut fixture, &ack), TC_ACT_OK);
    assert_eq!(verdict(&mut fixture, &denied), TC_ACT_SHOT);
    assert_eq!(verdict(&mut fixture, &cluster), TC_ACT_OK);
    assert_eq!(verdict(&mut fixture, &unmatched), TC_ACT_OK);
    let events = audit_events(&fixture);
    // The SYN, the denied packet and the IPv6 connection; not the ACK (same connection), not
    // the exempt pod-network connection.
    let summary: Vec<(u32, u8, u16, u16)> = events
        .iter()
        .map(|e| (e.rule, e.verdict, e.src_port, e.dst_port))
        .collect();
    assert_eq!(
        summary,
        vec![
            (0, ACL_VERDICT_ALLOW, 40000, 443),
            (1, ACL_VERDICT_DENY, 40001, 80),
            (3, ACL_VERDICT_ALLOW, 40003, 22),
        ]
    );
    for event in &events {
        assert_eq!(event.set, set);
        assert_eq!(event.protocol, 6);
        assert_eq!(event.direction, ACL_DIRECTION_EGRESS);
        assert_eq!(event.kind, ACL_KIND_FIREWALL);
        assert_eq!(event.suppressed, 0);
        assert!(event.time_ns > 0);
    }
    assert_eq!(events[1].src, addr16(IpAddr::from(TEAM_POD)));
    assert_eq!(events[1].dst, addr16(IpAddr::from(web)));
    assert_eq!(events[2].src, TEAM_POD6);
    let counters = fixture.counters();
    assert_eq!(counters.packets(Hook::FromPod, PacketClass::AuditLogged), 3);
    assert_eq!(
        counters.packets(Hook::FromPod, PacketClass::AuditSuppressed),
        0
    );

    // Over the per-CPU rate: a burst of the rate goes out, the rest is counted; the next
    // record after the bucket refills says how many were suppressed. The buckets are per CPU:
    // this thread stays on one for the rest of the test.
    dataplane_tests::fixture::pin_to_one_cpu();
    fixture.set_audit_rate(3).expect("rate");
    std::thread::sleep(std::time::Duration::from_millis(1100));
    for _ in 0..10 {
        assert_eq!(verdict(&mut fixture, &denied), TC_ACT_SHOT);
    }
    assert_eq!(audit_events(&fixture).len(), 3);
    std::thread::sleep(std::time::Duration::from_millis(400));
    assert_eq!(verdict(&mut fixture, &denied), TC_ACT_SHOT);
    let after = audit_events(&fixture);
    assert_eq!(after.len(), 1);
    assert_eq!(after[0].suppressed, 7);
    let counters = fixture.counters();
    assert_eq!(
        counters.packets(Hook::FromPod, PacketClass::AuditSuppressed),
        7
    );
}

/// The team's firewall allowing `hosts` single addresses (203.0.113.1 on) and denying the
/// rest: `hosts` + 1 prefixes.
fn hosts_firewall(hosts: u8) -> String {
    let mut yaml = String::from(
        "apiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\n\
         metadata: {name: default, namespace: team}\nspec:\n  egress:\n",
    );
    for host in 1..=hosts {
        yaml.push_str(&format!(
            "  - {{type: Allow, to: {{cidrSelector: 203.0.113.{host}/32}}}}\n"
        ));
    }
    yaml.push_str("  - {type: Deny, to: {cidrSelector: 0.0.0.0/0}}\n");
    yaml
}

/// A set larger than the prefix map can hold (written in one batch call): the firewall is
/// refused alone, naming the map and the flag to raise (the sync goes on), and the firewall
/// in force stays whole: the same set id, its entries, and its verdicts.
#[test]
fn a_firewall_larger_than_the_prefix_map_names_the_map_and_the_last_good_rules_stay() {
    if !privileged(
        "a_firewall_larger_than_the_prefix_map_names_the_map_and_the_last_good_rules_stay",
    ) {
        return;
    }
    let capacities = Capacities {
        acl_entries: 24,
        ..Capacities::default()
    };
    let mut fixture = Fixture::load_with(&capacities).expect("programs load");
    let mut state = AclState::default();
    let good = desired(TEAM_FIREWALL);
    fixture.sync_acl(&mut state, &good, &pods()).expect("sync");
    let set = state.firewall_set("team").expect("team has a firewall");
    let before = installed(&mut fixture);
    assert_eq!(before, (vec![set], port_entries(&good)));
    let large = hosts_firewall(40);
    // Refused alone: the sync goes on (for every other namespace), naming the firewall, the
    // map and the flag to raise.
    let stats = fixture
        .sync_acl(&mut state, &desired(&large), &pods())
        .expect("a firewall that does not fit fails alone, not the sync");
    assert_eq!(stats.closed.len(), 1, "{:?}", stats.closed);
    let why = &stats.closed[0];
    assert!(
        why.starts_with("EgressFirewall team/default: its rules could not be written"),
        "{why}"
    );
    assert!(
        why.contains(ACL_ADDRS) && why.contains("raise --max-acl-entries"),
        "{why}"
    );
    assert!(why.ends_with("its last good rules stay in force"), "{why}");
    assert_eq!(
        state.firewall_set("team"),
        Some(set),
        "the set in force stays"
    );
    assert_eq!(
        installed(&mut fixture),
        before,
        "what was written of the large set went again"
    );
    // Each later sync tries the large set again: the maps do not fill up with its pieces.
    for _ in 0..3 {
        let stats = fixture
            .sync_acl(&mut state, &desired(&large), &pods())
            .expect("still refused alone");
        assert_eq!(stats.closed.len(), 1, "still too large");
        assert_eq!(installed(&mut fixture), before);
    }
    assert_eq!(endpoint_sets(&mut fixture)[0].1, set);
    let web = [192, 0, 2, 5];
    assert_eq!(
        verdict(&mut fixture, &tcp_v4_flow(TEAM_POD, 40000, web, 443, true)),
        TC_ACT_OK
    );
    assert_eq!(
        verdict(&mut fixture, &tcp_v4_flow(TEAM_POD, 40000, web, 80, true)),
        TC_ACT_SHOT
    );
    assert_eq!(
        verdict(
            &mut fixture,
            &tcp_v4_flow(TEAM_POD, 40000, [203, 0, 113, 1], 80, true)
        ),
        TC_ACT_SHOT,
        "the large firewall's allow is not in force"
    );
    // A firewall that fits beside the one in force takes its place, and the old set goes.
    let fits = desired(&hosts_firewall(4));
    fixture
        .sync_acl(&mut state, &fits, &pods())
        .expect("5 prefixes fit beside the set in force");
    let new_set = state.firewall_set("team").expect("team has a firewall");
    assert_ne!(new_set, set);
    assert_eq!(
        installed(&mut fixture),
        (vec![new_set], port_entries(&fits))
    );
    assert_eq!(
        verdict(
            &mut fixture,
            &tcp_v4_flow(TEAM_POD, 40000, [203, 0, 113, 1], 80, true)
        ),
        TC_ACT_OK
    );
}
