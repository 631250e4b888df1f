use std::{net::IpAddr, sync::Arc};

use dataplane_common::acl::{ACL_MAX_LENGTHS, ACL_RULE_EXEMPT, MAX_FIREWALL_RULES};
use ipnet::IpNet;

use crate::api::egressfirewall::{
    EgressFirewall, EgressFirewallDestination, EgressFirewallPort, EgressFirewallRule,
    EgressFirewallSpec,
};

use super::{
    firewall::{
        DnsAddresses, FirewallContext, FirewallError, compile_firewall, compile_firewalls,
        compile_firewalls_reusing, firewall_rules,
    },
    *,
};

const ICMP: u8 = 1;

fn net(s: &str) -> IpNet {
    s.parse().expect("valid CIDR")
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("valid address")
}

fn rule(type_: &str, cidr: &str, ports: &[(&str, Option<i32>)]) -> EgressFirewallRule {
    EgressFirewallRule {
        type_: type_.into(),
        to: EgressFirewallDestination {
            cidr_selector: Some(cidr.into()),
            dns_name: None,
        },
        ports: ports
            .iter()
            .map(|(protocol, port)| EgressFirewallPort {
                protocol: (*protocol).into(),
                port: *port,
            })
            .collect(),
    }
}

fn firewall(namespace: &str, rules: Vec<EgressFirewallRule>) -> EgressFirewall {
    let mut object = EgressFirewall::new("default", EgressFirewallSpec { egress: rules });
    object.metadata.namespace = Some(namespace.into());
    object
}

fn compiled(rules: Vec<EgressFirewallRule>) -> CompiledSet {
    let rules =
        firewall_rules(&firewall("team", rules), &DnsAddresses::new()).expect("valid firewall");
    compile_firewall(&rules, &FirewallContext::default()).unwrap()
}

fn allow(rule: u32) -> Option<Outcome> {
    Some(Outcome {
        verdict: Verdict::Allow,
        rule,
    })
}

fn deny(rule: u32) -> Option<Outcome> {
    Some(Outcome {
        verdict: Verdict::Deny,
        rule,
    })
}

#[test]
fn allow_then_deny_all_and_the_same_rules_reversed() {
    let set = compiled(vec![
        rule("Allow", "192.0.2.0/24", &[]),
        rule("Deny", "0.0.0.0/0", &[]),
    ]);
    assert_eq!(set.lookup(ip("192.0.2.7"), PROTO_TCP, 443), allow(0));
    assert_eq!(set.lookup(ip("192.0.2.7"), ICMP, 0), allow(0));
    assert_eq!(set.lookup(ip("198.51.100.1"), PROTO_UDP, 53), deny(1));
    // Both prefixes decide alone: no port table at all.
    assert!(set.tables.is_empty());
    assert_eq!(set.prefixes.len(), 2);

    let reversed = compiled(vec![
        rule("Deny", "0.0.0.0/0", &[]),
        rule("Allow", "192.0.2.0/24", &[]),
    ]);
    assert_eq!(reversed.lookup(ip("192.0.2.7"), PROTO_TCP, 443), deny(0));
    assert_eq!(reversed.lookup(ip("198.51.100.1"), PROTO_TCP, 443), deny(0));
}

#[test]
fn port_only_rules_split_the_port_space() {
    let set = compiled(vec![
        rule(
            "Allow",
            "0.0.0.0/0",
            &[("TCP", Some(443)), ("UDP", Some(53))],
        ),
        rule("Deny", "0.0.0.0/0", &[]),
    ]);
    let dst = ip("203.0.113.9");
    assert_eq!(set.lookup(dst, PROTO_TCP, 443), allow(0));
    assert_eq!(set.lookup(dst, PROTO_UDP, 53), allow(0));
    assert_eq!(set.lookup(dst, PROTO_TCP, 444), deny(1));
    assert_eq!(set.lookup(dst, PROTO_TCP, 442), deny(1));
    assert_eq!(set.lookup(dst, PROTO_UDP, 443), deny(1));
    assert_eq!(set.lookup(dst, PROTO_SCTP, 443), deny(1));
    assert_eq!(set.lookup(dst, ICMP, 0), deny(1));
    // One table: two exact ports around the default.
    assert_eq!(set.tables.len(), 1);
    assert_eq!(set.tables[0].default, deny(1));
    assert_eq!(set.tables[0].entries(), 2);
}

#[test]
fn protocol_only_rules_cover_every_port_of_the_protocol() {
    let set = compiled(vec![
        rule("Deny", "198.51.100.0/24", &[("UDP", None)]),
        rule("Allow", "198.51.100.0/24", &[]),
    ]);
    let dst = ip("198.51.100.20");
    for port in [0, 1, 53, 65535] {
        assert_eq!(set.lookup(dst, PROTO_UDP, port), deny(0), "UDP {port}");
    }
    assert_eq!(set.lookup(dst, PROTO_TCP, 53), allow(1));
    assert_eq!(set.lookup(dst, ICMP, 0), allow(1));
    // Outside the prefix no rule matches: the firewall's default (allow) applies.
    assert_eq!(set.lookup(ip("198.51.101.1"), PROTO_UDP, 53), None);
}

#[test]
fn ipv6_cidrs_are_matched_apart_from_ipv4() {
    let set = compiled(vec![
        rule("Allow", "2001:db8:1::/48", &[("TCP", Some(443))]),
        rule("Deny", "::/0", &[]),
    ]);
    assert_eq!(set.lookup(ip("2001:db8:1::5"), PROTO_TCP, 443), allow(0));
    assert_eq!(set.lookup(ip("2001:db8:1::5"), PROTO_TCP, 80), deny(1));
    assert_eq!(set.lookup(ip("2001:db8:2::5"), PROTO_TCP, 443), deny(1));
    assert_eq!(set.lookup(ip("192.0.2.1"), PROTO_TCP, 443), None);
}

#[test]
fn a_more_specific_later_rule_is_shadowed_where_an_earlier_one_matches() {
    let set = compiled(vec![
        rule("Deny", "10.0.0.0/8", &[("TCP", Some(22))]),
        rule("Allow", "10.1.2.0/24", &[]),
        rule("Deny", "10.0.0.0/8", &[]),
    ]);
    assert_eq!(set.lookup(ip("10.1.2.3"), PROTO_TCP, 22), deny(0));
    assert_eq!(set.lookup(ip("10.1.2.3"), PROTO_TCP, 80), allow(1));
    assert_eq!(set.lookup(ip("10.9.9.9"), PROTO_TCP, 80), deny(2));
}

#[test]
fn cluster_networks_and_node_dns_are_exempt() {
    let rules = firewall_rules(
        &firewall("team", vec![rule("Deny", "0.0.0.0/0", &[])]),
        &DnsAddresses::new(),
    )
    .expect("valid firewall");
    let context = FirewallContext {
        exempt: vec![net("10.244.0.0/16"), net("10.96.0.0/16")],
        node_addresses: vec![ip("10.99.0.1")],
    };
    let set = compile_firewall(&rules, &context).unwrap();
    assert_eq!(
        set.lookup(ip("10.244.3.4"), PROTO_TCP, 80),
        allow(ACL_RULE_EXEMPT)
    );
    assert_eq!(
        set.lookup(ip("10.96.0.10"), PROTO_UDP, 53),
        allow(ACL_RULE_EXEMPT)
    );
    assert_eq!(
        set.lookup(ip("10.99.0.1"), PROTO_UDP, 53),
        allow(ACL_RULE_EXEMPT)
    );
    assert_eq!(
        set.lookup(ip("10.99.0.1"), PROTO_TCP, 53),
        allow(ACL_RULE_EXEMPT)
    );
    assert_eq!(set.lookup(ip("10.99.0.1"), PROTO_TCP, 22), deny(0));
    assert_eq!(set.lookup(ip("10.99.0.2"), PROTO_UDP, 53), deny(0));
    assert_eq!(set.lookup(ip("8.8.8.8"), PROTO_UDP, 53), deny(0));
}

#[test]
fn over_the_rule_limit_or_one_bad_field_rejects_the_object_whole() {
    let too_many: Vec<_> = (0..=MAX_FIREWALL_RULES)
        .map(|i| rule("Allow", &format!("10.{}.{}.0/24", i / 256, i % 256), &[]))
        .collect();
    assert_eq!(
        firewall_rules(&firewall("team", too_many), &DnsAddresses::new()).unwrap_err(),
        FirewallError::TooManyRules {
            namespace: "team".into(),
            name: "default".into(),
            count: 8001
        }
    );
    let exactly: Vec<_> = (0..MAX_FIREWALL_RULES)
        .map(|i| rule("Allow", &format!("10.{}.{}.0/24", i / 256, i % 256), &[]))
        .collect();
    assert_eq!(
        firewall_rules(&firewall("team", exactly), &DnsAddresses::new())
            .unwrap()
            .rules
            .len(),
        8000
    );

    let cases = [
        (
            rule("Allow", "10.0.0.0/33", &[]),
            "spec.egress[1]: to.cidrSelector \"10.0.0.0/33\" is not a CIDR",
        ),
        (
            rule("Allow", "10.0.0.0/8", &[("ICMP", None)]),
            "spec.egress[1]: ports[0]: protocol \"ICMP\" is not TCP, UDP or SCTP",
        ),
        (
            rule(
                "Allow",
                "10.0.0.0/8",
                &[("TCP", Some(80)), ("TCP", Some(70000))],
            ),
            "spec.egress[1]: ports[1]: port 70000 is outside 1-65535",
        ),
        (
            rule("Reject", "10.0.0.0/8", &[]),
            "spec.egress[1]: type \"Reject\" is neither Allow nor Deny",
        ),
    ];
    for (bad, message) in cases {
        let object = firewall("team", vec![rule("Allow", "192.0.2.0/24", &[]), bad]);
        let error = firewall_rules(&object, &DnsAddresses::new())
            .unwrap_err()
            .to_string();
        assert_eq!(
            error,
            format!(
                "EgressFirewall team/default: {message}; the namespace keeps its last good rules"
            )
        );
    }
}

#[test]
fn a_rejected_namespace_is_listed_and_others_still_compile() {
    let good = firewall("good", vec![rule("Deny", "0.0.0.0/0", &[])]);
    let bad = firewall("bad", vec![rule("Deny", "300.0.0.0/8", &[])]);
    let mut other_name = firewall("good", vec![]);
    other_name.metadata.name = Some("extra".into());
    let compiled = compile_firewalls(
        &[Arc::new(good), Arc::new(bad), Arc::new(other_name)],
        &FirewallContext::default(),
        &DnsAddresses::new(),
    );
    assert_eq!(
        compiled.desired.sets.keys().collect::<Vec<_>>(),
        vec!["good"]
    );
    assert_eq!(
        compiled.desired.rejected.iter().collect::<Vec<_>>(),
        vec!["bad"]
    );
    assert_eq!(compiled.errors.len(), 2, "{:?}", compiled.errors);
    assert!(
        compiled
            .errors
            .iter()
            .any(|e| e.contains("good/extra: ignored"))
    );
}

#[test]
fn port_ranges_become_buckets_and_edge_ports() {
    // A range as NetworkPolicy's endPort writes it, then deny the rest.
    let rules = [
        Rule {
            index: 0,
            verdict: Verdict::Allow,
            destinations: vec![net("0.0.0.0/0")],
            except: Vec::new(),
            peers: Vec::new(),
            ports: Ports::Only(vec![
                PortMatch {
                    protocol: PROTO_TCP,
                    first: 1000,
                    last: 2000,
                },
                PortMatch::all_ports(PROTO_UDP),
            ]),
        },
        Rule {
            index: 1,
            verdict: Verdict::Deny,
            destinations: vec![net("0.0.0.0/0")],
            except: Vec::new(),
            peers: Vec::new(),
            ports: Ports::Any,
        },
    ];
    let set = compile_rules(&rules, false).unwrap();
    let table = &set.tables[0];
    // Buckets 1024-1279 .. 1792-2047 allow (1792-2047 by majority), ports 1000-1023 allow
    // exactly, 2001-2047 deny exactly; UDP allows as a whole protocol.
    assert_eq!(table.buckets.len(), 4);
    assert_eq!(table.exact.len(), 24 + 47);
    assert_eq!(table.protocols.len(), 1);
    let dst = ip("192.0.2.1");
    for protocol in [PROTO_TCP, PROTO_UDP, PROTO_SCTP, ICMP] {
        for port in 0..=u16::MAX {
            assert_eq!(
                set.lookup(dst, protocol, port),
                first_matching_rule(&rules, dst, protocol, port),
                "protocol {protocol} port {port}"
            );
        }
    }
}

#[test]
fn more_prefix_lengths_than_lookups_are_expanded_into_fewer() {
    // Twelve lengths in one family; the kernel tries at most eight.
    let rules: Vec<Rule> = (0..12u8)
        .map(|i| Rule {
            index: u32::from(i),
            verdict: if i % 2 == 0 {
                Verdict::Deny
            } else {
                Verdict::Allow
            },
            destinations: vec![IpNet::new(ip("10.1.2.3"), 8 + 2 * i).unwrap().trunc()],
            except: Vec::new(),
            peers: Vec::new(),
            ports: Ports::Any,
        })
        .collect();
    let set = compile_rules(&rules, false).unwrap();
    assert_eq!(set.v4_lengths.len(), ACL_MAX_LENGTHS);
    assert!(
        set.v4_lengths.windows(2).all(|w| w[0] > w[1]),
        "longest first"
    );
    assert!(
        set.prefixes
            .keys()
            .all(|p| set.v4_lengths.contains(&p.prefix_len()))
    );
    let mut rng = Rng(7);
    for _ in 0..5000 {
        let dst = IpAddr::from([
            10,
            rng.below(3) as u8,
            rng.below(4) as u8,
            rng.below(256) as u8,
        ]);
        assert_eq!(
            set.lookup(dst, PROTO_TCP, 80),
            first_matching_rule(&rules, dst, PROTO_TCP, 80),
            "{dst}"
        );
    }
}

#[test]
fn identical_port_tables_are_shared() {
    // One rule naming two destinations (as a DNS name resolving to two addresses will).
    let set = compile_rules(
        &[Rule {
            index: 0,
            verdict: Verdict::Allow,
            destinations: vec![net("192.0.2.0/24"), net("198.51.100.0/24")],
            except: Vec::new(),
            peers: Vec::new(),
            ports: Ports::Only(vec![PortMatch::port(PROTO_TCP, 80)]),
        }],
        false,
    )
    .unwrap();
    assert_eq!(set.prefixes.len(), 2);
    assert_eq!(set.tables.len(), 1);
}

/// A small deterministic generator (xorshift64*), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The semantics the compile must reproduce: scan the rules in order.
fn first_matching_rule(rules: &[Rule], dst: IpAddr, protocol: u8, port: u16) -> Option<Outcome> {
    rules
        .iter()
        .find(|rule| {
            rule.destinations.iter().any(|n| n.contains(&dst))
                && !rule.except.iter().any(|n| n.contains(&dst))
                && match &rule.ports {
                    Ports::Any => true,
                    Ports::Only(matches) => matches
                        .iter()
                        .any(|m| m.protocol == protocol && (m.first..=m.last).contains(&port)),
                }
        })
        .map(|rule| Outcome {
            verdict: rule.verdict,
            rule: rule.index,
        })
}

#[test]
fn compiled_lookups_equal_scanning_the_rules_in_order() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let protocols = [PROTO_TCP, PROTO_UDP, PROTO_SCTP, ICMP];
    for round in 0..40 {
        // Prefixes inside 10.0.0.0/16 so that they nest and overlap often.
        let rules: Vec<Rule> = (0..(5 + round * 3))
            .map(|index| {
                let len = 16 + rng.below(17) as u8;
                let addr = IpAddr::from([10, 0, rng.below(256) as u8, rng.below(256) as u8]);
                let ports = if rng.below(3) == 0 {
                    Ports::Any
                } else {
                    Ports::Only(
                        (0..1 + rng.below(3))
                            .map(|_| {
                                let protocol = protocols[rng.below(3) as usize];
                                if rng.below(4) == 0 {
                                    PortMatch::all_ports(protocol)
                                } else {
                                    let first = rng.below(20) as u16 + 1;
                                    PortMatch {
                                        protocol,
                                        first,
                                        last: first + rng.below(5) as u16,
                                    }
                                }
                            })
                            .collect(),
                    )
                };
                Rule {
                    index,
                    verdict: if rng.below(2) == 0 {
                        Verdict::Allow
                    } else {
                        Verdict::Deny
                    },
                    destinations: vec![IpNet::new(addr, len).expect("valid").trunc()],
                    // Now and then a hole, as ipBlock.except makes.
                    except: if len < 30 && rng.below(4) == 0 {
                        vec![
                            IpNet::new(addr, len + 1 + rng.below(u64::from(32 - len)) as u8)
                                .expect("valid")
                                .trunc(),
                        ]
                    } else {
                        Vec::new()
                    },
                    peers: Vec::new(),
                    ports,
                }
            })
            .collect();
        let set = compile_rules(&rules, false).unwrap();
        for _ in 0..2000 {
            let dst = IpAddr::from([10, 0, rng.below(256) as u8, rng.below(256) as u8]);
            let protocol = protocols[rng.below(4) as usize];
            let port = if protocol == ICMP {
                0
            } else {
                rng.below(30) as u16
            };
            assert_eq!(
                set.lookup(dst, protocol, port),
                first_matching_rule(&rules, dst, protocol, port),
                "round {round}: {dst} proto {protocol} port {port}"
            );
        }
    }
}

/// A recompile from the last one gives what a fresh compile gives: unchanged namespaces keep
/// their sets, a changed rule or a changed context is compiled anew.
#[test]
fn a_recompile_from_the_last_one_equals_a_fresh_compile() {
    let dns = DnsAddresses::new();
    let context = FirewallContext::default();
    let shop = Arc::new(firewall("shop", vec![rule("Deny", "10.0.0.0/8", &[])]));
    let bank = Arc::new(firewall("bank", vec![rule("Allow", "192.0.2.0/24", &[])]));
    let previous = compile_firewalls(&[shop.clone(), bank.clone()], &context, &dns);
    let changed_bank = Arc::new(firewall("bank", vec![rule("Deny", "192.0.2.0/24", &[])]));
    let objects = [shop, changed_bank];
    let again = compile_firewalls_reusing(&objects, &context, &dns, &previous);
    let fresh = compile_firewalls(&objects, &context, &dns);
    assert_eq!(again.desired.sets, fresh.desired.sets);
    assert_eq!(again.desired.sets["shop"], previous.desired.sets["shop"]);
    assert_ne!(again.desired.sets["bank"], previous.desired.sets["bank"]);
    // Another context: every namespace compiled against it.
    let wider = FirewallContext {
        exempt: vec![net("10.128.0.0/14")],
        ..FirewallContext::default()
    };
    let again = compile_firewalls_reusing(&objects, &wider, &dns, &previous);
    assert_eq!(
        again.desired.sets,
        compile_firewalls(&objects, &wider, &dns).desired.sets
    );
    assert_ne!(again.desired.sets["shop"], previous.desired.sets["shop"]);
}

/// An old port table is written over with a new one in place only when every prefix that took
/// it takes the new one (or is gone): no prefix may see a table that is neither its old nor its
/// new one while a set changes in place.
#[test]
fn a_port_table_is_rewritten_in_place_only_for_the_prefixes_that_follow_it() {
    let set = |prefixes: &[(&str, Decision)]| CompiledSet {
        prefixes: Arc::new(prefixes.iter().map(|(p, d)| (net(p), *d)).collect()),
        ..CompiledSet::default()
    };
    let old = set(&[
        ("10.0.0.1/32", Decision::Table(0)),
        ("10.0.0.2/32", Decision::Table(0)),
        ("10.0.0.3/32", Decision::Table(1)),
    ]);
    // 10.0.0.2 leaves, the others keep their tables' places.
    let fewer = set(&[
        ("10.0.0.1/32", Decision::Table(0)),
        ("10.0.0.3/32", Decision::Table(1)),
    ]);
    assert!(table_follows(&old, 0, &fewer, 0));
    assert!(table_follows(&old, 1, &fewer, 1));
    assert!(!table_follows(&old, 0, &fewer, 1));
    // 10.0.0.2 moves to the other table, or to no table: table 0 may not become table 0.
    let moved = set(&[
        ("10.0.0.1/32", Decision::Table(0)),
        ("10.0.0.2/32", Decision::Table(1)),
        ("10.0.0.3/32", Decision::Table(1)),
    ]);
    assert!(!table_follows(&old, 0, &moved, 0));
    assert!(table_follows(&old, 1, &moved, 1));
    let unmatched = set(&[
        ("10.0.0.1/32", Decision::Table(0)),
        ("10.0.0.2/32", Decision::Unmatched),
    ]);
    assert!(!table_follows(&old, 0, &unmatched, 0));
    // A table no prefix took may become any.
    assert!(table_follows(&fewer, 2, &moved, 0));
}

/// What a compiled set decides for each of its prefixes, its tables read through (indexes
/// are set-local, so two compiles deciding alike may number their tables apart).
fn resolved(set: &CompiledSet) -> Vec<(IpNet, Result<Option<Outcome>, PortTable>)> {
    set.prefixes
        .iter()
        .map(|(prefix, decision)| {
            let resolved = match decision {
                Decision::Final(outcome) => Ok(Some(*outcome)),
                Decision::Unmatched => Ok(None),
                Decision::Table(index) => Err(set.tables[*index].clone()),
            };
            (*prefix, resolved)
        })
        .collect()
}

/// A peer host of the randomized tests (every fifth IPv6).
fn peer_host(n: u64) -> IpNet {
    if n.is_multiple_of(5) {
        format!("fd00::{:x}/128", n).parse().unwrap()
    } else {
        format!("10.1.{}.{}/32", n / 200, n % 200).parse().unwrap()
    }
}

/// Adds or takes out one of 400 peer hosts at random, of `others` a third of the time.
fn toggle_peer(
    rng: &mut crate::test_rng::TestRng,
    peers: &mut BTreeSet<u64>,
    others: &mut BTreeSet<u64>,
) {
    let n = rng.below(400) + 1;
    let list = if rng.below(3) == 0 { others } else { peers };
    if !list.remove(&n) {
        list.insert(n);
    }
}

/// Two tiers over peer hosts, with `ports` for each rule: a pass to `others` (the first
/// tier), an allow to `peers`, an allow to a CIDR with holes, a deny of everything.
fn tiered_rules(peers: &BTreeSet<u64>, others: &BTreeSet<u64>, ports: [Ports; 4]) -> Vec<Rule> {
    let hosts = |set: &BTreeSet<u64>| set.iter().map(|&n| peer_host(n)).collect();
    let parts = [
        (Verdict::Pass, hosts(others), Vec::new()),
        (Verdict::Allow, hosts(peers), Vec::new()),
        (
            Verdict::Allow,
            vec![net("10.1.0.0/24")],
            vec![net("10.1.0.128/25"), net("10.1.0.7/32")],
        ),
        (
            Verdict::Deny,
            vec![net("0.0.0.0/0"), net("::/0")],
            Vec::new(),
        ),
    ];
    parts
        .into_iter()
        .zip(ports)
        .enumerate()
        .map(|(index, ((verdict, destinations, except), ports))| Rule {
            index: index as u32,
            verdict,
            destinations,
            except,
            peers: Vec::new(),
            ports,
        })
        .collect()
}

/// Peers coming and going as /32s and /128s among two tiers of rules (a port rule, a pass,
/// a CIDR with a hole, a deny-all), at random over 300 steps: each incremental set decides
/// every prefix as the whole compile of the same rules does, with the same lengths; a change
/// other than hosts, or a new length, asks for the whole compile.
#[test]
fn host_peers_recompiled_alone_decide_as_the_whole_compile() {
    let tcp = |port: u16| Ports::Only(vec![PortMatch::port(6, port)]);
    let rules = |peers: &BTreeSet<u64>, others: &BTreeSet<u64>| -> Vec<Rule> {
        tiered_rules(peers, others, [tcp(22), tcp(8080), Ports::Any, Ports::Any])
    };
    let (mut last_rules, mut last) = (Vec::new(), CompiledSet::default());
    for host_lengths in [true, false] {
        let mut rng = crate::test_rng::TestRng::new(25);
        let mut peers: BTreeSet<u64> = (1..40).collect();
        let mut others: BTreeSet<u64> = (30..50).collect();
        last_rules = rules(&peers, &others);
        last = compile_tiered(&last_rules, 1, host_lengths).unwrap();
        for step in 0..300 {
            toggle_peer(&mut rng, &mut peers, &mut others);
            let now = rules(&peers, &others);
            let whole = compile_tiered(&now, 1, host_lengths).unwrap();
            let incremental = recompile_hosts(&last_rules, &last, &now, 1, host_lengths)
                .unwrap_or_else(|| panic!("step {step}: hosts alone changed"));
            assert_eq!(
                resolved(&incremental),
                resolved(&whole),
                "step {step}, host lengths {host_lengths}"
            );
            assert_eq!(
                (&incremental.v4_lengths, &incremental.v6_lengths),
                (&whole.v4_lengths, &whole.v6_lengths)
            );
            last_rules = now;
            last = incremental;
        }
    }
    // Not hosts: a port, a CIDR, a new length.
    let mut port = last_rules.clone();
    port[1].ports = tcp(8081);
    assert!(recompile_hosts(&last_rules, &last, &port, 1, true).is_none());
    let mut cidr = last_rules.clone();
    cidr[1].destinations.push(net("10.9.0.0/16"));
    assert!(recompile_hosts(&last_rules, &last, &cidr, 1, true).is_none());
    // The last IPv6 hosts gone: without host lengths kept, the set's lengths change.
    let mut v4_only = last_rules.clone();
    for rule in &mut v4_only[..2] {
        rule.destinations.retain(|d| matches!(d, IpNet::V4(_)));
    }
    assert!(last.v6_lengths.contains(&128));
    assert!(
        !compile_tiered(&v4_only, 1, false)
            .unwrap()
            .v6_lengths
            .contains(&128)
    );
    assert!(recompile_hosts(&last_rules, &last, &v4_only, 1, false).is_none());
}

/// A set's covers with their decisions resolved (table indexes are set-local), by rules.
type ResolvedCovers = BTreeMap<Vec<usize>, (Vec<IpNet>, Result<Option<Outcome>, PortTable>)>;

fn resolved_covers(set: &CompiledSet) -> ResolvedCovers {
    let covers = set.covers.as_ref().expect("covers");
    let mut out = BTreeMap::new();
    for cover in covers {
        let decision = match cover.decision {
            Decision::Final(outcome) => Ok(Some(outcome)),
            Decision::Unmatched => Ok(None),
            Decision::Table(index) => Err(set.tables[index].clone()),
        };
        for prefix in &cover.prefixes {
            assert_eq!(set.prefixes.get(prefix), Some(&cover.decision), "{prefix}");
        }
        let before = out.insert(cover.rules.clone(), (cover.prefixes.clone(), decision));
        assert!(before.is_none(), "one cover per rules: {:?}", cover.rules);
    }
    let listed: usize = covers.iter().map(|c| c.prefixes.len()).sum();
    assert_eq!(listed, set.prefixes.len(), "every prefix in one cover");
    out
}

/// Peers coming and going and rules' ports changing at random over 400 steps, each step
/// made from the last as a pod's set is (`recompile_hosts`, else `repaint_ports`): every
/// prefix is decided as the whole compile of the same rules decides it, the covers are the
/// whole compile's, and a repaint leaves no table that no prefix takes. A port changed on the rule of
/// a cover that alone takes its table rewrites that table in place: no prefix changes.
#[test]
fn ports_repainted_by_cover_decide_as_the_whole_compile() {
    let choices = [
        Ports::Any,
        Ports::Only(vec![PortMatch::port(6, 8080)]),
        Ports::Only(vec![PortMatch::port(6, 8081)]),
        Ports::Only(vec![PortMatch::port(17, 53), PortMatch::port(6, 53)]),
        Ports::Only(vec![PortMatch {
            protocol: 6,
            first: 8000,
            last: 8999,
        }]),
        Ports::Only(vec![PortMatch::all_ports(17)]),
    ];
    let rules = |peers: &BTreeSet<u64>, others: &BTreeSet<u64>, ports: &[usize; 4]| {
        tiered_rules(peers, others, ports.map(|choice| choices[choice].clone()))
    };
    let mut rng = crate::test_rng::TestRng::new(7);
    let mut peers: BTreeSet<u64> = (1..40).collect();
    let mut others: BTreeSet<u64> = (30..50).collect();
    let mut ports = [1, 1, 0, 0];
    let mut last_rules = rules(&peers, &others, &ports);
    let mut last = compile_tiered(&last_rules, 1, true).unwrap();
    let mut repainted = 0;
    for step in 0..400 {
        if rng.below(2) == 0 {
            ports[rng.below(4) as usize] = rng.below(choices.len() as u64) as usize;
        } else {
            toggle_peer(&mut rng, &mut peers, &mut others);
        }
        let now = rules(&peers, &others, &ports);
        let whole = compile_tiered(&now, 1, true).unwrap();
        let mut by_ports = false;
        let incremental = recompile_hosts(&last_rules, &last, &now, 1, true)
            .or_else(|| {
                by_ports = true;
                repaint_ports(&last_rules, &last, &now, 1)
            })
            .unwrap_or_else(|| panic!("step {step}: hosts or ports alone changed"));
        assert_eq!(resolved(&incremental), resolved(&whole), "step {step}");
        assert_eq!(
            resolved_covers(&incremental),
            resolved_covers(&whole),
            "step {step}"
        );
        let taken: BTreeSet<usize> = incremental
            .prefixes
            .values()
            .filter_map(|d| match d {
                Decision::Table(index) => Some(*index),
                _ => None,
            })
            .collect();
        if by_ports {
            repainted += 1;
            assert_eq!(taken.len(), incremental.tables.len(), "step {step}");
        }
        last_rules = now;
        last = incremental;
    }
    assert!(repainted > 100, "{repainted} port changes");
    // The peers' rule from 8080 to 8081: its cover alone takes its table.
    ports = [0, 1, 0, 0];
    let before_rules = rules(&peers, &others, &ports);
    let before = compile_tiered(&before_rules, 1, true).unwrap();
    ports[1] = 2;
    let after = repaint_ports(&before_rules, &before, &rules(&peers, &others, &ports), 1)
        .expect("ports alone changed");
    assert_eq!(after.prefixes, before.prefixes);
    assert_eq!(after.tables.len(), before.tables.len());
    assert_ne!(after.tables, before.tables);
    // Anything else than ports: no repaint.
    let mut cidr = before_rules.clone();
    cidr[2].destinations.push(net("10.9.0.0/16"));
    assert!(repaint_ports(&before_rules, &before, &cidr, 1).is_none());
    let mut verdict = before_rules.clone();
    verdict[1].verdict = Verdict::Deny;
    assert!(repaint_ports(&before_rules, &before, &verdict, 1).is_none());
}

/// What `recompile_hosts` looks at: the networks one rule names and the other does not, as
/// the ordered sets' symmetric difference gives them (truncated, each once, in order).
#[test]
fn the_networks_two_rules_differ_by_are_those_of_the_sets_difference() {
    let mut rng = crate::test_rng::TestRng::new(3);
    for _ in 0..400 {
        let pick = |rng: &mut crate::test_rng::TestRng, count: u64| -> Vec<IpNet> {
            (0..rng.below(count))
                .map(|_| {
                    let host = format!(
                        "10.0.{}.{}/{}",
                        rng.below(3),
                        rng.below(6),
                        30 + rng.below(3)
                    );
                    net(&host)
                })
                .collect()
        };
        let a = pick(&mut rng, 12);
        // Unrelated lists (differing in many networks or few), and a list with one network
        // more or less (as a peer added or removed gives).
        let b = match rng.below(3) {
            0 => pick(&mut rng, 40),
            1 => {
                let mut b = a.clone();
                let at = rng.below(b.len() as u64 + 1) as usize;
                b.insert(
                    at,
                    net(&format!("10.0.{}.{}/32", rng.below(3), rng.below(6))),
                );
                b
            }
            _ => {
                let mut b = a.clone();
                if !b.is_empty() {
                    b.remove(rng.below(b.len() as u64) as usize);
                }
                b
            }
        };
        let set = |nets: &[IpNet]| -> std::collections::BTreeSet<IpNet> {
            nets.iter().map(IpNet::trunc).collect()
        };
        let expected: Vec<IpNet> = set(&a).symmetric_difference(&set(&b)).copied().collect();
        assert_eq!(sorted_difference_of(&a, &b), expected, "{a:?} {b:?}");
    }
}

/// The sets in force walked beside the wanted ones: each wanted name gets its set in force
/// (or none), the names no longer wanted are listed, and applying the moves leaves the map
/// as wanted, a kept name (a rejected firewall's namespace) holding its last set, and the
/// sets that names left returned.
#[test]
fn the_sets_in_force_follow_the_wanted_names_and_return_what_they_left() {
    use std::collections::{BTreeMap, BTreeSet};
    let names = |list: &[(&str, u32)]| -> BTreeMap<String, u32> {
        list.iter().map(|(n, s)| (n.to_string(), *s)).collect()
    };
    let in_force = names(&[("a", 1), ("c", 3), ("d", 4), ("f", 6)]);
    let wanted = names(&[("b", 0), ("c", 0), ("d", 0), ("g", 0)]);
    let (current, gone) = super::in_force_beside(&wanted, &in_force);
    assert_eq!(current, vec![None, Some(3), Some(4), None]);
    assert_eq!(gone, vec!["a".to_string(), "f".to_string()]);
    let (none, nothing_gone) = super::in_force_beside(&wanted, &BTreeMap::new());
    assert_eq!((none, nothing_gone.len()), (vec![None; 4], 0));
    let (nothing, all_gone) = super::in_force_beside(&BTreeMap::<String, ()>::new(), &in_force);
    assert_eq!((nothing.len(), all_gone.len()), (0, 4));

    // "b" and "g" installed, "d" replaced; "a" kept (rejected), "f" gone.
    let moves = super::Moves {
        moved: vec![
            ("b".into(), None, 7),
            ("d".into(), Some(4), 8),
            ("g".into(), None, 9),
        ],
        gone,
    };
    let mut map = in_force.clone();
    let keep: BTreeSet<String> = ["a".to_string()].into();
    let mut displaced = moves.apply(&mut map, &keep);
    displaced.sort();
    assert_eq!(
        map,
        names(&[("a", 1), ("b", 7), ("c", 3), ("d", 8), ("g", 9)])
    );
    assert_eq!(displaced, vec![4, 6]);
}

/// The cost of lengthening prefixes is counted without wrapping: 256 IPv6 /8 networks
/// lengthened to /128 are 2^128 entries, which a wrapping shift counted as none and chose,
/// expanding without end. Counted right, the cheap lengths are merged and the set is small.
#[test]
fn prefix_expansion_costs_are_counted_without_wrapping() {
    let mut destinations: Vec<IpNet> = (0..=255u16)
        .map(|b| net(&format!("{:x}00::/8", b)))
        .collect();
    destinations.extend((1..8).map(|len| net(&format!("8000::/{len}"))));
    destinations.push(net("2001:db8::1/128"));
    let rule = Rule {
        index: 0,
        verdict: Verdict::Allow,
        destinations,
        except: Vec::new(),
        peers: Vec::new(),
        ports: Ports::Any,
    };
    let started = std::time::Instant::now();
    let set = compile_rules(&[rule], false).expect("fits");
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    assert!(set.prefixes.len() < 300, "{}", set.prefixes.len());
    assert_eq!(set.v6_lengths.len(), ACL_MAX_LENGTHS);
    // Where no cheap length is left, the set is refused before anything is expanded.
    let spread = Rule {
        index: 0,
        verdict: Verdict::Allow,
        destinations: [0u8, 16, 32, 48, 64, 80, 96, 112, 128]
            .iter()
            .map(|len| net(&format!("2001:db8::/{len}")).trunc())
            .chain((0..8).map(|i| net(&format!("2001:db8:{i}::/16")).trunc()))
            .collect(),
        except: Vec::new(),
        peers: Vec::new(),
        ports: Ports::Any,
    };
    let error = compile_rules(&[spread], false).expect_err("too large");
    assert_eq!(error.limit, SET_MAX_PREFIXES);
    assert!(error.needed > SET_MAX_PREFIXES as u128);
    // Nine lengths: /1 lengthened to /2 is the cheapest step (two entries for one).
    assert_eq!(
        estimated_entries(
            (0..=255u16)
                .map(|b| net(&format!("{:x}00::/8", b)))
                .chain((1..8).map(|len| net(&format!("8000::/{len}"))))
                .chain([net("2001:db8::1/128")])
        ),
        256 + 7 - 1 + 2 + 1,
    );
}
