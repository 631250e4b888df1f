//! How fast the agent brings the maps to a cluster's state, and what one change costs.
//!
//! - Converge from empty: 10,000 Services with 10 ready endpoints each (100,000 backends) and
//!   100 namespaces with a 100-rule EgressFirewall each (and a local pod each), from the YAML
//!   text to the maps: parse (the manifest source's own parser), compile the services, write
//!   them (Maglev tables included), compile the firewalls, write them. Target: under 2 s.
//! - One change: the same steps the agent takes on any change (everything re-read and
//!   compiled, the maps diffed) for one EndpointSlice gaining an endpoint, and for one
//!   namespace's firewall changing one rule; in the big cluster and in a small one (10
//!   services, 1 namespace). Map writes should not depend on the cluster's size: the ratio of
//!   writes big/small is printed (1.0 means proportional to the changed object alone), next to
//!   the time ratio (which includes re-reading and re-compiling everything).
//!
//! Runs against real maps (programs loaded into this kernel under a private pin root). A
//! benchmark: it reports, it does not pass or fail.

use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr},
    time::{Duration, Instant},
};

use clap::Parser;
use dataplane_tests::fixture::Fixture;
use dataplane_user::{
    acl::{
        AclPod, AclState,
        firewall::{FirewallContext, compile_firewalls},
    },
    lb::{self, LbState},
    source::{ClusterState, add_documents},
};
use serde::Serialize;

#[derive(Parser)]
struct Args {
    #[arg(long)]
    json: bool,
}

const NODE: &str = "node-a";

/// A cluster of `services` services and `namespaces` firewalled namespaces.
struct Shape {
    services: usize,
    endpoints: usize,
    namespaces: usize,
    rules: usize,
}

const BIG: Shape = Shape {
    services: 10_000,
    endpoints: 10,
    namespaces: 100,
    rules: 100,
};
const SMALL: Shape = Shape {
    services: 10,
    endpoints: 10,
    namespaces: 1,
    rules: 100,
};

/// Endpoint `k` of the cluster: distinct addresses under 10.128.0.0/9.
fn endpoint(k: usize) -> Ipv4Addr {
    Ipv4Addr::from(0x0a80_0000u32 + k as u32)
}

/// The manifests of `shape`; `extra_endpoint` gives service 0 one more endpoint, and
/// `changed_rule` moves rule 0 of namespace 0 to another CIDR.
fn manifests(shape: &Shape, extra_endpoint: bool, changed_rule: bool) -> String {
    let mut yaml = String::new();
    for i in 0..shape.services {
        let namespace = format!("ns-{}", i % shape.namespaces.max(1));
        let ip = Ipv4Addr::from(0x0a60_0000u32 + 1 + i as u32);
        let _ = write!(
            yaml,
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: svc-{i}, namespace: {namespace}}}\n\
             spec: {{clusterIP: {ip}, clusterIPs: [{ip}], ports: [{{name: http, port: 80, protocol: TCP, targetPort: 8080}}]}}\n\
             ---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
             metadata: {{name: svc-{i}-1, namespace: {namespace}, labels: {{kubernetes.io/service-name: svc-{i}}}}}\n\
             addressType: IPv4\nports: [{{name: http, port: 8080, protocol: TCP}}]\nendpoints:\n"
        );
        let count = shape.endpoints + usize::from(extra_endpoint && i == 0);
        for j in 0..count {
            let address = if j < shape.endpoints {
                endpoint(i * shape.endpoints + j)
            } else {
                Ipv4Addr::new(10, 255, 255, 1)
            };
            let _ = writeln!(
                yaml,
                "- addresses: [{address}]\n  conditions: {{ready: true}}"
            );
        }
    }
    for n in 0..shape.namespaces {
        let _ = write!(
            yaml,
            "---\napiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\n\
             metadata: {{name: default, namespace: ns-{n}}}\nspec:\n  egress:\n"
        );
        for r in 0..shape.rules - 1 {
            let third = if changed_rule && n == 0 && r == 0 {
                250
            } else {
                r
            };
            let _ = writeln!(
                yaml,
                "  - {{type: Allow, to: {{cidrSelector: 198.{}.{third}.0/24}}, ports: [{{protocol: TCP, port: 443}}]}}",
                n % 256
            );
        }
        let _ = writeln!(yaml, "  - {{type: Deny, to: {{cidrSelector: 0.0.0.0/0}}}}");
    }
    yaml
}

fn pods(shape: &Shape) -> Vec<AclPod> {
    (0..shape.namespaces)
        .map(|n| AclPod {
            namespace: format!("ns-{n}"),
            name: format!("pod-{n}"),
            addresses: vec![IpAddr::V4(Ipv4Addr::new(10, 244, 1, 1 + n as u8))],
        })
        .collect()
}

fn context() -> FirewallContext {
    FirewallContext {
        exempt: vec![
            "10.128.0.0/9".parse().expect("CIDR"),
            "10.96.0.0/12".parse().expect("CIDR"),
        ],
        node_addresses: vec!["10.99.0.1".parse().expect("address")],
    }
}

/// What one pass (read, compile, write) took and wrote.
#[derive(Clone, Copy, Debug, Default, Serialize)]
struct Pass {
    parse_ms: f64,
    services_compile_ms: f64,
    services_write_ms: f64,
    firewalls_compile_ms: f64,
    firewalls_write_ms: f64,
    total_ms: f64,
    /// Map entries written plus deleted.
    service_writes: usize,
    firewall_writes: usize,
}

/// The agent's state between passes over one set of maps.
struct Agent {
    fixture: Fixture,
    lb: LbState,
    acl: AclState,
    pods: Vec<AclPod>,
}

impl Agent {
    fn new(shape: &Shape) -> anyhow::Result<Self> {
        Ok(Self {
            fixture: Fixture::load()?,
            lb: LbState::default(),
            acl: AclState::default(),
            pods: pods(shape),
        })
    }

    /// What the agent does on every change: read everything, compile everything, write the
    /// difference.
    fn pass(&mut self, yaml: &str) -> anyhow::Result<Pass> {
        let mut pass = Pass::default();
        let started = Instant::now();
        let mut state = ClusterState::default();
        add_documents(&mut state, "bench", yaml);
        anyhow::ensure!(state.rejected.is_empty(), "{:?}", state.rejected);
        let mut lap = Instant::now();
        pass.parse_ms = ms(started.elapsed());
        let compiled = lb::compile_services(&state.services, &state.endpoint_slices, NODE);
        anyhow::ensure!(compiled.errors.is_empty(), "{:?}", compiled.errors);
        pass.services_compile_ms = ms(lap.elapsed());
        lap = Instant::now();
        let stats = self.fixture.sync_lb(&mut self.lb, &compiled.ports)?;
        pass.services_write_ms = ms(lap.elapsed());
        pass.service_writes = stats.written + stats.deleted;
        lap = Instant::now();
        let firewalls = compile_firewalls(&state.egress_firewalls, &context(), &Default::default());
        anyhow::ensure!(firewalls.errors.is_empty(), "{:?}", firewalls.errors);
        pass.firewalls_compile_ms = ms(lap.elapsed());
        lap = Instant::now();
        let stats = self
            .fixture
            .sync_acl(&mut self.acl, &firewalls.desired, &self.pods)?;
        pass.firewalls_write_ms = ms(lap.elapsed());
        pass.firewall_writes = stats.written + stats.deleted;
        pass.total_ms = ms(started.elapsed());
        Ok(pass)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[derive(Serialize)]
struct Report {
    converge: Pass,
    /// One EndpointSlice gaining an endpoint, in the big and the small cluster.
    endpoint_change_big: Pass,
    endpoint_change_small: Pass,
    endpoint_change_writes_ratio: f64,
    endpoint_change_time_ratio: f64,
    /// One firewall rule changed, in the big and the small cluster.
    rule_change_big: Pass,
    rule_change_small: Pass,
    rule_change_writes_ratio: f64,
    rule_change_time_ratio: f64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let base = manifests(&BIG, false, false);
    let mut big = Agent::new(&BIG)?;
    let converge = big.pass(&base)?;
    let endpoint_change_big = big.pass(&manifests(&BIG, true, false))?;
    let rule_change_big = big.pass(&manifests(&BIG, true, true))?;
    drop(big);

    let mut small = Agent::new(&SMALL)?;
    small.pass(&manifests(&SMALL, false, false))?;
    let endpoint_change_small = small.pass(&manifests(&SMALL, true, false))?;
    let rule_change_small = small.pass(&manifests(&SMALL, true, true))?;
    drop(small);

    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    let report = Report {
        endpoint_change_writes_ratio: ratio(
            endpoint_change_big.service_writes as f64,
            endpoint_change_small.service_writes as f64,
        ),
        endpoint_change_time_ratio: ratio(
            endpoint_change_big.total_ms,
            endpoint_change_small.total_ms,
        ),
        rule_change_writes_ratio: ratio(
            rule_change_big.firewall_writes as f64,
            rule_change_small.firewall_writes as f64,
        ),
        rule_change_time_ratio: ratio(rule_change_big.total_ms, rule_change_small.total_ms),
        converge,
        endpoint_change_big,
        endpoint_change_small,
        rule_change_big,
        rule_change_small,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let c = &report.converge;
    println!(
        "sync: {} services x {} endpoints + {} namespaces x {} firewall rules, from empty",
        BIG.services, BIG.endpoints, BIG.namespaces, BIG.rules
    );
    println!(
        "  converge {:.0} ms (target < 2000): parse {:.0}, services compile {:.0} + write {:.0} ({} entries), firewalls compile {:.0} + write {:.0} ({} entries)",
        c.total_ms,
        c.parse_ms,
        c.services_compile_ms,
        c.services_write_ms,
        c.service_writes,
        c.firewalls_compile_ms,
        c.firewalls_write_ms,
        c.firewall_writes
    );
    println!(
        "  one endpoint added:  {} map writes in the big cluster, {} in the small one (ratio {:.2}); pass {:.0} ms vs {:.1} ms (ratio {:.0}, re-reading and re-compiling everything)",
        report.endpoint_change_big.service_writes,
        report.endpoint_change_small.service_writes,
        report.endpoint_change_writes_ratio,
        report.endpoint_change_big.total_ms,
        report.endpoint_change_small.total_ms,
        report.endpoint_change_time_ratio
    );
    println!(
        "  one firewall rule:   {} map writes in the big cluster, {} in the small one (ratio {:.2}); pass {:.0} ms vs {:.1} ms (ratio {:.0})",
        report.rule_change_big.firewall_writes,
        report.rule_change_small.firewall_writes,
        report.rule_change_writes_ratio,
        report.rule_change_big.total_ms,
        report.rule_change_small.total_ms,
        report.rule_change_time_ratio
    );
    Ok(())
}
