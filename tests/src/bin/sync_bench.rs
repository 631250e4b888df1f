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
        firewall::{
            CompiledFirewalls, FirewallContext, compile_firewalls, compile_firewalls_reusing,
        },
    },
    changes::{Changes, Stage},
    lb::{self, LbState, ServiceCache},
    source::{ClusterState, ManifestCache, add_documents},
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
    manifest_files(shape, extra_endpoint, changed_rule).concat()
}

/// The same manifests as one text per namespace (its Services, their EndpointSlices and its
/// EgressFirewall): the files of a manifest directory.
fn manifest_files(shape: &Shape, extra_endpoint: bool, changed_rule: bool) -> Vec<String> {
    let mut files = vec![String::new(); shape.namespaces.max(1)];
    for i in 0..shape.services {
        let yaml = &mut files[i % shape.namespaces.max(1)];
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
    for (n, yaml) in files.iter_mut().enumerate().take(shape.namespaces) {
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
    files
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
        let compiled = lb::compile_services(
            &state.services,
            &state.endpoint_slices,
            &lb::LocalNode::from_nodes(&state.nodes, NODE),
            &lb::AddressPolicy::default(),
        );
        anyhow::ensure!(compiled.errors.is_empty(), "{:?}", compiled.errors);
        pass.services_compile_ms = ms(lap.elapsed());
        lap = Instant::now();
        let stats = self.fixture.sync_lb(&mut self.lb, &compiled.ports)?;
        pass.services_write_ms = ms(lap.elapsed());
        pass.service_writes = stats.written + stats.deleted;
        lap = Instant::now();
        let firewalls = compile_firewalls(
            &state.egress_firewalls.to_vec(),
            &context(),
            &Default::default(),
        );
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

/// What one incremental sync (the agent's path since the dependency model) took and wrote.
#[derive(Clone, Debug, Default, Serialize)]
struct Step {
    /// Reading the directory: only changed files parsed again, the state assembled.
    read_ms: f64,
    /// What changed, kind by kind, against the last state.
    diff_ms: f64,
    /// The stages that ran: compile and write.
    stages_ms: f64,
    total_ms: f64,
    stages: Vec<&'static str>,
    services_recompiled: usize,
    /// Map entries written plus deleted.
    writes: usize,
}

/// The agent's incremental path over a manifest directory, one file per namespace.
struct Incremental {
    fixture: Fixture,
    dir: std::path::PathBuf,
    files: Vec<String>,
    cache: ManifestCache,
    last: Option<ClusterState>,
    services: ServiceCache,
    lb: LbState,
    acl: AclState,
    pods: Vec<AclPod>,
    /// The last compile of the firewalls.
    firewalls: CompiledFirewalls,
}

impl Incremental {
    fn new(shape: &Shape, name: &str) -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!("sync-bench-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        Ok(Self {
            fixture: Fixture::load()?,
            dir,
            files: Vec::new(),
            cache: ManifestCache::default(),
            last: None,
            services: ServiceCache::default(),
            lb: LbState::default(),
            acl: AclState::default(),
            pods: pods(shape),
            firewalls: CompiledFirewalls::default(),
        })
    }

    /// Writes the files that differ (not timed), then syncs as the agent does after a
    /// change: read (changed files parsed), diff, the stages the change reaches.
    fn step(&mut self, files: Vec<String>) -> anyhow::Result<Step> {
        // The files written are those inotify names to the agent (`ManifestWatch::take_named`).
        let mut named = std::collections::BTreeSet::new();
        for (n, text) in files.iter().enumerate() {
            if self.files.get(n) != Some(text) {
                let path = self.dir.join(format!("ns-{n:03}.yaml"));
                std::fs::write(&path, text)?;
                named.insert(path);
            }
        }
        self.files = files;
        let mut step = Step::default();
        let started = Instant::now();
        let state = self.cache.read_named(&self.dir, &named)?;
        anyhow::ensure!(state.rejected.is_empty(), "{:?}", state.rejected);
        step.read_ms = ms(started.elapsed());
        let lap = Instant::now();
        let changes = match &self.last {
            Some(last) => Changes::between(last, &state),
            None => Changes::full(),
        };
        step.diff_ms = ms(lap.elapsed());
        let lap = Instant::now();
        step.stages = changes.stages().iter().map(|s| s.name()).collect();
        if changes.runs(Stage::Services) {
            step.services_recompiled = self.services.update(
                &state.services,
                &state.endpoint_slices,
                &lb::LocalNode::from_nodes(&state.nodes, NODE),
                &lb::AddressPolicy::default(),
                &changes,
            );
            let errors = self.services.errors();
            anyhow::ensure!(errors.is_empty(), "{errors:?}");
            let stats = self.services.sync_maps(&mut self.fixture, &mut self.lb)?;
            step.writes += stats.written + stats.deleted;
        }
        if changes.runs(Stage::AccessControl) {
            // As the firewall agent does: unchanged namespaces keep their compiled sets.
            let firewalls = compile_firewalls_reusing(
                &state.egress_firewalls.to_vec(),
                &context(),
                &Default::default(),
                &self.firewalls,
            );
            anyhow::ensure!(firewalls.errors.is_empty(), "{:?}", firewalls.errors);
            let stats = self
                .fixture
                .sync_acl(&mut self.acl, &firewalls.desired, &self.pods)?;
            step.writes += stats.written + stats.deleted;
            self.firewalls = firewalls;
        }
        step.stages_ms = ms(lap.elapsed());
        step.total_ms = ms(started.elapsed());
        self.last = Some(state);
        Ok(step)
    }
}

impl Drop for Incremental {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One change through the incremental path in the big and the small cluster.
#[derive(Serialize)]
struct IncrementalChange {
    big: Step,
    small: Step,
    time_ratio: f64,
}

/// The incremental path: converge from empty, then one endpoint and one firewall rule, in
/// the big and the small cluster.
fn incremental() -> anyhow::Result<(Step, IncrementalChange, IncrementalChange)> {
    let mut big = Incremental::new(&BIG, "big")?;
    let converge = big.step(manifest_files(&BIG, false, false))?;
    let endpoint_big = big.step(manifest_files(&BIG, true, false))?;
    let rule_big = big.step(manifest_files(&BIG, true, true))?;
    drop(big);
    let mut small = Incremental::new(&SMALL, "small")?;
    small.step(manifest_files(&SMALL, false, false))?;
    let endpoint_small = small.step(manifest_files(&SMALL, true, false))?;
    let rule_small = small.step(manifest_files(&SMALL, true, true))?;
    let change = |big: Step, small: Step| IncrementalChange {
        time_ratio: big.total_ms / small.total_ms.max(1e-6),
        big,
        small,
    };
    Ok((
        converge,
        change(endpoint_big, endpoint_small),
        change(rule_big, rule_small),
    ))
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
    /// The agent's incremental path (a manifest directory of one file per namespace).
    incremental_converge: Step,
    incremental_endpoint_change: IncrementalChange,
    incremental_rule_change: IncrementalChange,
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
    let (incremental_converge, incremental_endpoint_change, incremental_rule_change) =
        incremental()?;

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
        incremental_converge,
        incremental_endpoint_change,
        incremental_rule_change,
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
    let c = &report.incremental_converge;
    println!(
        "  incremental path (the agent's, {} files): converge {:.0} ms (read {:.0}, stages {:.0})",
        BIG.namespaces, c.total_ms, c.read_ms, c.stages_ms
    );
    for (what, change) in [
        ("one endpoint added", &report.incremental_endpoint_change),
        ("one firewall rule", &report.incremental_rule_change),
    ] {
        let (b, s) = (&change.big, &change.small);
        println!(
            "  {what}: {:.1} ms in the big cluster (read {:.1}, diff {:.1}, stages {:?} {:.1}; {} services recompiled, {} writes) vs {:.2} ms in the small one: ratio {:.1} (target: under 10 ms, within 2x)",
            b.total_ms,
            b.read_ms,
            b.diff_ms,
            b.stages,
            b.stages_ms,
            b.services_recompiled,
            b.writes,
            s.total_ms,
            change.time_ratio
        );
    }
    Ok(())
}
