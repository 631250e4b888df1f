//! Cost of the EgressFirewall as its rule count grows: 1, 100, 1000 and 8000 rules.
//!
//! - Ours: `tc_from_pod` under BPF_PROG_TEST_RUN (kernel-timed mean of many runs) for a pod
//!   whose namespace has the firewall, against the same packet from a pod without one (the
//!   difference is the ACL stage). Two probes: one into a rule's CIDR that the port table
//!   decides (the deepest trie walk), one that only the final `0.0.0.0/0` rule matches.
//! - nftables: the same rules as one chain on the output hook of a namespace, timed per
//!   `sendto()` of a UDP datagram that only the last rule matches (a chain is evaluated rule
//!   by rule), against the same namespace without the chain.
//! - Compile: agent time to validate and compile 8000 rules, and to write them to the maps.
//! - Admin policies: `tc_from_pod` for a pod under 1, 10 and 100 AdminNetworkPolicies of 100
//!   rules each plus a NetworkPolicy, against the same pod under one admin rule of the same
//!   shape plus the NetworkPolicy (whole program, ratio; the NetworkPolicy alone is shown
//!   too); denied probes, so every run does the lookups (an allowed flow is tracked and skips
//!   them): one into an admin rule's network and port, one that no rule matches (the
//!   NetworkPolicy's isolation denies). Compile time and map entries of 100 x 100.
//!
//! All measured in one run, rounds interleaved; medians reported. A benchmark: it reports, it
//! does not pass or fail.

use std::{
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    time::{Duration, Instant},
};

use clap::Parser;
use dataplane_common::maps::PROG_FROM_POD;
use dataplane_tests::{
    fixture::Fixture,
    median,
    netns::ThreadNetns,
    packets::{tcp_v4_flow, udp_v4_flow},
    topology::run_in,
};
use dataplane_user::{
    acl::{
        AclPod, AclState, DesiredFirewalls,
        admin::validate_all,
        firewall::{FirewallContext, compile_firewalls},
    },
    api::egressfirewall::{
        EgressFirewall, EgressFirewallDestination, EgressFirewallPort, EgressFirewallRule,
        EgressFirewallSpec,
    },
};
use serde::Serialize;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 15)]
    rounds: u32,
    /// Program runs per measurement (BPF_PROG_TEST_RUN repeat).
    #[arg(long, default_value_t = 200_000)]
    repeat: u32,
    /// Time spent sending per nftables measurement.
    #[arg(long, default_value_t = 200)]
    send_ms: u64,
    #[arg(long)]
    json: bool,
}

const SIZES: [usize; 4] = [1, 100, 1000, 8000];

/// The targets the report states: the whole program's cost at the most firewall rules over
/// one rule, and each admin policy shape's over one admin rule.
const FIREWALL_RATIO_TARGET: f64 = 1.2;
const ADMIN_RATIO_TARGET: f64 = 1.1;
const FIREWALLED: [u8; 4] = [10, 244, 1, 9];
const UNFIREWALLED: [u8; 4] = [10, 244, 1, 10];
/// Only the final rule matches it.
const LAST_RULE_TARGET: [u8; 4] = [203, 0, 113, 5];

/// The CIDR of rule `i` (before the final deny): distinct /24s under 172.16.0.0/11.
fn rule_net(i: usize) -> [u8; 4] {
    [172, 16 + (i >> 8) as u8, (i & 0xff) as u8, 0]
}

/// `count` rules: allow UDP 443 to a /24 each, then deny everything.
fn firewall(count: usize) -> EgressFirewall {
    let mut egress: Vec<EgressFirewallRule> = (0..count - 1)
        .map(|i| {
            let n = rule_net(i);
            EgressFirewallRule {
                type_: "Allow".into(),
                to: EgressFirewallDestination {
                    cidr_selector: Some(format!("{}.{}.{}.0/24", n[0], n[1], n[2])),
                    dns_name: None,
                },
                ports: vec![EgressFirewallPort {
                    protocol: "UDP".into(),
                    port: Some(443),
                }],
            }
        })
        .collect();
    egress.push(EgressFirewallRule {
        type_: "Deny".into(),
        to: EgressFirewallDestination {
            cidr_selector: Some("0.0.0.0/0".into()),
            dns_name: None,
        },
        ports: Vec::new(),
    });
    let mut object = EgressFirewall::new("default", EgressFirewallSpec { egress });
    object.metadata.namespace = Some("bench".into());
    object
}

fn context() -> FirewallContext {
    FirewallContext {
        exempt: vec![
            "10.244.0.0/16".parse().expect("CIDR"),
            "10.96.0.0/16".parse().expect("CIDR"),
        ],
        node_addresses: vec!["10.99.0.1".parse().expect("address")],
    }
}

fn pods() -> Vec<AclPod> {
    vec![AclPod {
        namespace: "bench".into(),
        name: "pod".into(),
        addresses: vec![FIREWALLED.into()],
    }]
}

/// Programs loaded with a `count`-rule firewall; also returns the compile and sync times.
fn loaded_with(count: usize) -> anyhow::Result<(Fixture, Duration, Duration)> {
    let mut fixture = Fixture::load()?;
    let objects = [std::sync::Arc::new(firewall(count))];
    let started = Instant::now();
    let compiled = compile_firewalls(&objects, &context(), &Default::default());
    let compile = started.elapsed();
    anyhow::ensure!(compiled.errors.is_empty(), "{:?}", compiled.errors);
    let started = Instant::now();
    fixture.sync_acl(&mut AclState::default(), &compiled.desired, &pods())?;
    Ok((fixture, compile, started.elapsed()))
}

/// The probes through our programs: (name, frame).
fn probes(count: usize) -> Vec<(&'static str, Vec<u8>)> {
    // A rule in the middle of the list; with one rule there is only the final one.
    let middle = rule_net((count.saturating_sub(1)) / 2);
    let inside = [middle[0], middle[1], middle[2], 7];
    vec![
        ("no firewall", udp_v4_flow(UNFIREWALLED, 40000, inside, 443)),
        (
            "rule's CIDR, port table",
            udp_v4_flow(FIREWALLED, 40000, inside, 443),
        ),
        (
            "only the last rule",
            udp_v4_flow(FIREWALLED, 40000, LAST_RULE_TARGET, 443),
        ),
    ]
}

/// The nftables chain of the same rules (output hook; the final rule drops).
fn nft_ruleset(count: usize) -> String {
    let mut rules = String::from(
        "table ip bench {\n  chain egress {\n    type filter hook output priority 0; policy accept;\n",
    );
    for i in 0..count - 1 {
        let n = rule_net(i);
        let _ = writeln!(
            rules,
            "    ip daddr {}.{}.{}.0/24 udp dport 443 accept",
            n[0], n[1], n[2]
        );
    }
    rules.push_str("    ip daddr 0.0.0.0/0 drop\n  }\n}\n");
    rules
}

/// Mean ns per `sendto()` of a datagram to `LAST_RULE_TARGET` over `send_ms`.
fn send_cost(socket: &UdpSocket, send_ms: u64) -> f64 {
    let target = SocketAddr::from((Ipv4Addr::from(LAST_RULE_TARGET), 443));
    let payload = [0u8; 64];
    let deadline = Duration::from_millis(send_ms);
    let started = Instant::now();
    let mut sent = 0u64;
    while started.elapsed() < deadline {
        for _ in 0..64 {
            // Dropped by the chain (EPERM) or by the dummy device: both are the measurement.
            let _ = socket.send_to(&payload, target);
        }
        sent += 64;
    }
    started.elapsed().as_nanos() as f64 / sent as f64
}

/// Per-packet ns of the nftables chains, for each size and without a chain, in interleaved
/// rounds inside a namespace of our own whose default route leads to a veth with its peer down.
fn nftables_costs(args: &Args) -> anyhow::Result<(f64, Vec<f64>)> {
    let netns = ThreadNetns::enter()?;
    // A veth whose peer stays down: the device drops what it is given, at the least cost
    // this kernel offers (it has no dummy device).
    netns.sh("link add d0 type veth peer name d1")?;
    netns.sh("addr add 192.168.250.1/24 dev d0")?;
    netns.sh("link set d0 up")?;
    netns.sh("route add default via 192.168.250.2 dev d0")?;
    netns.sh("neigh add 192.168.250.2 lladdr 02:00:00:00:00:02 dev d0")?;
    let socket = UdpSocket::bind("192.168.250.1:0")?;
    let files: Vec<std::path::PathBuf> = SIZES
        .iter()
        .map(|&count| {
            let path = std::env::temp_dir().join(dataplane_tests::unique_name("nft"));
            std::fs::write(&path, nft_ruleset(count)).map(|()| path)
        })
        .collect::<Result<_, _>>()?;
    let (mut baseline, mut samples) = (Vec::new(), vec![Vec::new(); SIZES.len()]);
    let result = (|| -> anyhow::Result<()> {
        for _ in 0..args.rounds {
            baseline.push(send_cost(&socket, args.send_ms));
            for (i, file) in files.iter().enumerate() {
                let path = file.to_str().unwrap_or_default();
                run_in(&netns.name, &["nft", "-f", path])?;
                samples[i].push(send_cost(&socket, args.send_ms));
                run_in(&netns.name, &["nft", "delete", "table", "ip", "bench"])?;
            }
        }
        Ok(())
    })();
    for file in &files {
        let _ = std::fs::remove_file(file);
    }
    result?;
    Ok((
        median(&baseline),
        samples.iter().map(|s| median(s)).collect(),
    ))
}

#[derive(Serialize)]
struct Report {
    rules: Vec<usize>,
    /// `[size][probe]` median ns per packet of `tc_from_pod`.
    ours_ns: Vec<Vec<f64>>,
    /// The ACL stage alone: firewalled probes minus the pod without a firewall.
    ours_stage_ns: Vec<Vec<f64>>,
    /// Whole-program cost at 8000 rules over 1 rule, per firewalled probe.
    ours_ratio_8000_to_1: Vec<f64>,
    /// Per `sendto()` without the chain, and with each chain.
    nftables_baseline_ns: f64,
    nftables_ns: Vec<f64>,
    nftables_ratio_8000_to_1: f64,
    compile_8000_ms: f64,
    sync_8000_ms: f64,
    admin: AdminReport,
}

/// (admin policies, rules each) measured: the NetworkPolicy alone, one admin rule (the
/// baseline of the ratios), then 1, 10 and 100 policies of `RULES_PER_ADMIN` rules.
const ADMIN_SHAPES: [(usize, usize); 5] = [
    (0, 0),
    (1, 1),
    (1, RULES_PER_ADMIN),
    (10, RULES_PER_ADMIN),
    (100, RULES_PER_ADMIN),
];
const RULES_PER_ADMIN: usize = 100;
/// The row the ratios divide by.
const ONE_ADMIN_RULE: usize = 1;
/// The pod under the policies.
const ADMIN_POD: [u8; 4] = [10, 244, 1, 20];

#[derive(Serialize)]
struct AdminReport {
    /// (policies, rules each).
    shapes: Vec<(usize, usize)>,
    /// `[count][probe]` median ns per packet of `tc_from_pod`; probes: an admin rule's network
    /// and port, no rule.
    ours_ns: Vec<Vec<f64>>,
    /// Each shape over one admin rule, per probe (target <= 1.1).
    ratio_to_one_rule: Vec<Vec<f64>>,
    /// Validating and compiling 100 policies x 100 rules for the pod.
    compile_100_ms: f64,
    sync_100_ms: f64,
    /// The pod's egress set at 100 policies: address and port entries.
    entries_100: usize,
}

/// `count` AdminNetworkPolicies of `rules` egress rules selecting namespace `bench`, and a
/// NetworkPolicy isolating its egress with one rule, as manifests.
fn admin_manifests(count: usize, rules: usize) -> String {
    let mut yaml = String::from(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: pods-only, namespace: bench}\nspec:\n  podSelector: {}\n  policyTypes: [Egress]\n  egress:\n  - to: [{ipBlock: {cidr: 10.244.0.0/16}}]\n",
    );
    for i in 0..count {
        let _ = write!(
            yaml,
            "---\napiVersion: policy.networking.k8s.io/v1alpha1\nkind: AdminNetworkPolicy\nmetadata: {{name: admin-{i}}}\nspec:\n  priority: {i}\n  subject: {{namespaces: {{matchLabels: {{kubernetes.io/metadata.name: bench}}}}}}\n  egress:\n"
        );
        for j in 0..rules {
            let action = if j % 2 == 0 { "Deny" } else { "Allow" };
            let _ = write!(
                yaml,
                "  - action: {action}\n    to: [{{networks: [172.{}.{j}.0/24]}}]\n    ports: [{{portNumber: {{protocol: TCP, port: 443}}}}]\n",
                16 + i
            );
        }
    }
    yaml
}

/// Programs loaded with `count` admin policies; also the compile and sync times and the
/// map entries of the pod's set.
fn loaded_with_admin(
    (count, rules): (usize, usize),
) -> anyhow::Result<(Fixture, Duration, Duration, usize)> {
    use dataplane_user::acl::{
        pods::{NamespaceLabels, PolicyPod, PolicyPods},
        policy::policy_sets,
        select::PolicyCluster,
    };
    let mut state = dataplane_user::source::ClusterState::default();
    dataplane_user::source::add_documents(&mut state, "bench.yaml", &admin_manifests(count, rules));
    anyhow::ensure!(state.rejected.is_empty(), "{:?}", state.rejected);
    let pods: PolicyPods = [PolicyPod {
        namespace: "bench".into(),
        name: "pod".into(),
        labels: Default::default(),
        addresses: vec![ADMIN_POD.into()],
        named_ports: Default::default(),
    }]
    .into_iter()
    .collect();
    let namespaces: NamespaceLabels = [(
        "bench".to_owned(),
        [("kubernetes.io/metadata.name".to_owned(), "bench".to_owned())].into(),
    )]
    .into_iter()
    .collect();
    let started = Instant::now();
    let validated = validate_all(&state.admin_objects(), &mut Default::default());
    anyhow::ensure!(validated.errors.is_empty(), "{:?}", validated.errors);
    let cluster = PolicyCluster::new(&pods, &namespaces);
    let compiled = policy_sets(
        &state.network_policies.to_vec(),
        &cluster,
        &["bench/pod".to_owned()],
        &Default::default(),
        &validated.policies,
    );
    let compile = started.elapsed();
    anyhow::ensure!(compiled.errors.is_empty(), "{:?}", compiled.errors);
    let entries = compiled
        .sets
        .values()
        .map(|set| {
            set.compiled.prefixes.len()
                + set
                    .compiled
                    .tables
                    .iter()
                    .map(|t| t.entries())
                    .sum::<usize>()
        })
        .sum();
    let desired = DesiredFirewalls {
        policy_sets: compiled.sets,
        pod_policies: compiled.pods,
        ..DesiredFirewalls::default()
    };
    let pod = AclPod {
        namespace: "bench".into(),
        name: "pod".into(),
        addresses: vec![ADMIN_POD.into()],
    };
    let mut fixture = Fixture::load()?;
    let started = Instant::now();
    fixture.sync_acl(&mut AclState::default(), &desired, &[pod])?;
    Ok((fixture, compile, started.elapsed(), entries))
}

/// Denied probes from the pod: TCP 443 into the network of a Deny rule in the middle of the
/// middle policy (with no admin policy: the same kind of address, which the isolation
/// denies), and an address no rule names.
fn admin_probes((count, rules): (usize, usize)) -> [Vec<u8>; 2] {
    let policy = count / 2;
    let target = [172, 16 + policy as u8, ((rules / 2) & !1) as u8, 7];
    [
        tcp_v4_flow(ADMIN_POD, 40000, target, 443, true),
        tcp_v4_flow(ADMIN_POD, 40000, [192, 0, 2, 1], 443, true),
    ]
}

fn admin_costs(args: &Args) -> anyhow::Result<AdminReport> {
    let mut fixtures = Vec::new();
    let (mut compile, mut sync, mut entries) = (Duration::ZERO, Duration::ZERO, 0);
    for shape in ADMIN_SHAPES {
        let (fixture, compiled_in, synced_in, set_entries) = loaded_with_admin(shape)?;
        (compile, sync, entries) = (compiled_in, synced_in, set_entries);
        fixtures.push(fixture);
    }
    let mut samples = vec![vec![Vec::new(); 2]; ADMIN_SHAPES.len()];
    for _ in 0..args.rounds {
        for (f, fixture) in fixtures.iter_mut().enumerate() {
            for (p, frame) in admin_probes(ADMIN_SHAPES[f]).iter().enumerate() {
                fixture.port_as_sender_of(frame)?;
                let run = fixture.run_tc(PROG_FROM_POD, frame, args.repeat)?;
                anyhow::ensure!(
                    run.action == 2,
                    "the probe is denied (action {})",
                    run.action
                );
                samples[f][p].push(run.duration.as_nanos() as f64);
            }
        }
    }
    let ours: Vec<Vec<f64>> = samples
        .iter()
        .map(|probes| probes.iter().map(|s| median(s)).collect())
        .collect();
    Ok(AdminReport {
        shapes: ADMIN_SHAPES.to_vec(),
        ratio_to_one_rule: ours
            .iter()
            .map(|row| {
                row.iter()
                    .zip(&ours[ONE_ADMIN_RULE])
                    .map(|(n, one)| n / one)
                    .collect()
            })
            .collect(),
        ours_ns: ours,
        compile_100_ms: compile.as_secs_f64() * 1e3,
        sync_100_ms: sync.as_secs_f64() * 1e3,
        entries_100: entries,
    })
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.rounds > 0 && args.repeat > 0,
        "rounds and repeat must be positive"
    );
    let mut fixtures = Vec::new();
    let (mut compile, mut sync) = (Duration::ZERO, Duration::ZERO);
    for count in SIZES {
        let (fixture, compiled_in, synced_in) = loaded_with(count)?;
        (compile, sync) = (compiled_in, synced_in);
        fixtures.push(fixture);
    }
    let probe_names: Vec<&str> = probes(1).iter().map(|(n, _)| *n).collect();
    let mut samples = vec![vec![Vec::new(); probe_names.len()]; SIZES.len()];
    for _ in 0..args.rounds {
        for (f, fixture) in fixtures.iter_mut().enumerate() {
            for (p, (_, frame)) in probes(SIZES[f]).iter().enumerate() {
                // The probe's pod passes port security; the firewall decides.
                fixture.port_as_sender_of(frame)?;
                let run = fixture.run_tc(PROG_FROM_POD, frame, args.repeat)?;
                samples[f][p].push(run.duration.as_nanos() as f64);
            }
        }
    }
    drop(fixtures);
    let ours: Vec<Vec<f64>> = samples
        .iter()
        .map(|probes| probes.iter().map(|s| median(s)).collect())
        .collect();
    let stage: Vec<Vec<f64>> = ours
        .iter()
        .map(|row| row[1..].iter().map(|ns| ns - row[0]).collect())
        .collect();
    let (nft_baseline, nft) = nftables_costs(&args)?;
    let admin = admin_costs(&args)?;
    let last = SIZES.len() - 1;
    let report = Report {
        rules: SIZES.to_vec(),
        ours_ratio_8000_to_1: (1..probe_names.len())
            .map(|p| ours[last][p] / ours[0][p])
            .collect(),
        ours_ns: ours,
        ours_stage_ns: stage,
        nftables_baseline_ns: nft_baseline,
        nftables_ratio_8000_to_1: nft[last] / nft[0],
        nftables_ns: nft,
        compile_8000_ms: compile.as_secs_f64() * 1e3,
        sync_8000_ms: sync.as_secs_f64() * 1e3,
        admin,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "EgressFirewall by rule count ({} rounds, medians; ours: BPF_PROG_TEST_RUN x{}; nftables: sendto() for {} ms)",
        args.rounds, args.repeat, args.send_ms
    );
    println!(
        "{:>6} {:>12} {:>16} {:>12} {:>16} {:>12} {:>14}",
        "rules", "no fw ns", "rule CIDR ns", "(stage)", "last rule ns", "(stage)", "nft sendto ns"
    );
    for (i, rules) in SIZES.iter().enumerate() {
        let (o, s) = (&report.ours_ns[i], &report.ours_stage_ns[i]);
        println!(
            "{:>6} {:>12.1} {:>16.1} {:>12.1} {:>16.1} {:>12.1} {:>14.1}",
            rules, o[0], o[1], s[0], o[2], s[1], report.nftables_ns[i]
        );
    }
    let (fewest, most) = (SIZES[0], SIZES[SIZES.len() - 1]);
    println!(
        "  ratio {most} rules / {fewest} rule, ours (whole tc program; target <= {FIREWALL_RATIO_TARGET}): rule CIDR {:.2}, last rule {:.2}",
        report.ours_ratio_8000_to_1[0], report.ours_ratio_8000_to_1[1]
    );
    println!(
        "  ratio {most} rules / {fewest} rule, nftables chain (whole sendto(); {:.0} ns without a chain): {:.1}",
        report.nftables_baseline_ns, report.nftables_ratio_8000_to_1
    );
    println!(
        "  agent: compile {most} rules {:.1} ms, write them to the maps {:.1} ms",
        report.compile_8000_ms, report.sync_8000_ms
    );
    let admin = &report.admin;
    println!(
        "\nAdmin policies of {RULES_PER_ADMIN} rules + a NetworkPolicy, tc_from_pod (ours: BPF_PROG_TEST_RUN x{}, medians)",
        args.repeat
    );
    println!(
        "{:>26} {:>14} {:>8} {:>12} {:>8}",
        "admin policies", "admin rule ns", "ratio", "no rule ns", "ratio"
    );
    for (i, (count, rules)) in admin.shapes.iter().enumerate() {
        let (o, r) = (&admin.ours_ns[i], &admin.ratio_to_one_rule[i]);
        let label = match (count, rules) {
            (0, _) => "none (NetworkPolicy alone)".to_owned(),
            (1, 1) => "1 rule (baseline)".to_owned(),
            (count, rules) => format!("{count} x {rules} rules"),
        };
        println!(
            "{label:>26} {:>14.1} {:>8.2} {:>12.1} {:>8.2}",
            o[0], r[0], o[1], r[1]
        );
    }
    let (most_policies, _) = ADMIN_SHAPES[ADMIN_SHAPES.len() - 1];
    println!(
        "  ratio to one admin rule: target <= {ADMIN_RATIO_TARGET}; agent: {most_policies} x {RULES_PER_ADMIN} rules compile {:.1} ms, write {:.1} ms, {} map entries",
        admin.compile_100_ms, admin.sync_100_ms, admin.entries_100
    );
    Ok(())
}
