//! The agent at the size of a large cluster: 5,000 nodes, 150,000 pods (110 on this node),
//! 10,000 Services of 10 endpoints, 2,000 NetworkPolicies, 100 EgressFirewalls of 100 rules.
//!
//! Objects go through the API source's path: each arrives as the API server's JSON, is decoded
//! as the agent's watchers decode it (`kubernetes::WatchedObject`) and then into its type
//! (`kubernetes::parse_watched`), parsed on its own into the per-object cache the Kubernetes
//! source keeps (`source::ObjectCache`, its only copy of the objects), and a sync assembles
//! the state, finds what changed (`changes::Changes`) and runs the stages that read it, as the
//! agent's `cluster` module does, into real maps in this kernel; access control is the
//! agent's own `FirewallAgent`, given its inputs as the agent gives them
//! (`FirewallInputs::from_state`). Figures:
//!
//! - the first sync from nothing (target under 2 s);
//! - one endpoint, one pod label, one policy changed, one pod added on another node and one
//!   node added: from the object's event to the maps written (target under 10 ms each, and
//!   within 2x of the same change in a cluster of 10 nodes, the two clusters' changes timed
//!   by turns);
//! - a stream of changes (1,000 a second for 30 s; endpoints, pod labels, pods added and
//!   deleted): each change's lag from its event to the
//!   maps holding it (p99 target under 100 ms), and whether the maps end as a full recompute
//!   has them;
//! - the resident memory of this process (the agent's state and the benchmark's objects;
//!   target under 1 GiB) and the kernel memory of its maps (`memlock` of each map's fdinfo).
//!
//! Not in it: EgressIP objects (the egress stage runs, selecting pods for none), the management
//! port's routes and the gateway's nftables table (host state, not maps), the reads of the
//! underlay's MTU and MAC and of the node's addresses (system calls the overlay stage makes at
//! every run, whatever the cluster's size). A benchmark: it
//! reports, it does not pass or fail.

use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr},
    path::Path,
    time::{Duration, Instant},
};

use clap::Parser;
use dataplane_tests::fixture::Fixture;
use dataplane_user::{
    acl::{
        agent::{FirewallAgent, FirewallFiles, FirewallInputs, HostedLists},
        pods::{PolicyChanges, PolicyPods},
    },
    changes::{Changes, Stage},
    egressip::{compile::EgressInputs, node::EgressNode},
    kubernetes::{Listing, Watched, WatchedObject, parse_watched},
    lb::{LbState, ServiceCache},
    model::Underlay,
    model::{self, HostInterface, NodeModel},
    multicast,
    overlay::{self, OverlayMaps},
    source::{ClusterState, ObjectCache},
};
use serde::Serialize;

#[derive(Parser)]
struct Args {
    /// A tenth of the cluster, one repeat, one second of stream: that it runs, no figures.
    #[arg(long)]
    smoke: bool,
    /// Changes per second in the stream.
    #[arg(long, default_value_t = 1000)]
    stream_rate: u64,
    /// How long the stream lasts, in seconds.
    #[arg(long, default_value_t = 30)]
    stream_seconds: u64,
    /// Repeats of each single change (the median is reported). Four blocks of
    /// [`BLOCK`]: with five repeats (one block), one run's ratio moved between 1.5 and 2.7
    /// from the next's, the small cluster's changes taking 0.1 to 0.2 ms.
    #[arg(long, default_value_t = 40)]
    repeats: usize,
    #[arg(long)]
    json: bool,
    /// Only the single changes whose description contains this (to profile one of them).
    #[arg(long)]
    only: Option<String>,
}

const NODE: &str = "node-0";

/// A cluster's size.
#[derive(Clone, Copy, Debug, Serialize)]
struct Shape {
    nodes: usize,
    pods: usize,
    /// Pods on this node (node 0).
    local_pods: usize,
    namespaces: usize,
    services: usize,
    endpoints: usize,
    policies: usize,
    firewalls: usize,
    rules: usize,
}

const LARGE: Shape = Shape {
    nodes: 5_000,
    pods: 150_000,
    local_pods: 110,
    namespaces: 500,
    services: 10_000,
    endpoints: 10,
    policies: 2_000,
    firewalls: 100,
    rules: 100,
};

/// A tenth of [`LARGE`] (this node's pods stay 110).
const SMOKE: Shape = Shape {
    nodes: 500,
    pods: 15_000,
    local_pods: 110,
    namespaces: 50,
    services: 1_000,
    endpoints: 10,
    policies: 200,
    firewalls: 10,
    rules: 100,
};

/// Ten nodes with this node's same 110 pods, under the same policies as in [`LARGE`]: each
/// local pod in a namespace of its own, picked by four NetworkPolicies (four a namespace),
/// a fifth of the namespaces under an EgressFirewall. Only the cluster around them is
/// smaller (a policy's peers, the services, the nodes). The reference for "within 2x":
/// with 40 policies over 50 namespaces, three in five local pods were under no policy, so
/// that every change's per-pod work was less than half the large cluster's whatever its size.
const SMALL: Shape = Shape {
    nodes: 10,
    pods: 380,
    local_pods: 110,
    namespaces: 120,
    services: 10,
    endpoints: 10,
    policies: 480,
    firewalls: 24,
    rules: 100,
};

/// Node `i`'s pod subnet: 10.(128 + i / 256).(i % 256).0/24, inside 10.128.0.0/9.
fn node_subnet(i: usize) -> [u8; 3] {
    [10, 128 + (i / 256) as u8, (i % 256) as u8]
}

/// Pod `p`'s node and address: the first `local_pods` on node 0, the rest spread over the
/// other nodes.
fn pod_place(shape: &Shape, p: usize) -> (usize, Ipv4Addr) {
    let (node, index) = if p < shape.local_pods {
        (0, p)
    } else {
        let q = p - shape.local_pods;
        (1 + q % (shape.nodes - 1), q / (shape.nodes - 1))
    };
    let [a, b, c] = node_subnet(node);
    (node, Ipv4Addr::new(a, b, c, 2 + index as u8))
}

fn network_yaml() -> String {
    "apiVersion: operator.openshift.io/v1\nkind: Network\nmetadata: {name: cluster}\n\
     spec: {clusterNetwork: [{cidr: 10.128.0.0/9, hostPrefix: 24}], serviceNetwork: [10.96.0.0/16]}\n"
        .into()
}

fn node_yaml(i: usize) -> String {
    let [a, b, c] = node_subnet(i);
    format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: node-{i}}}\n\
         spec: {{podCIDRs: [{a}.{b}.{c}.0/24]}}\n\
         status: {{addresses: [{{type: InternalIP, address: 172.16.{}.{}}}]}}\n",
        i / 250,
        i % 250 + 1
    )
}

fn namespace_yaml(n: usize) -> String {
    format!(
        "apiVersion: v1\nkind: Namespace\n\
         metadata: {{name: ns-{n}, labels: {{team: t-{}, kubernetes.io/metadata.name: ns-{n}}}}}\n",
        n % 10
    )
}

/// How many `app` labels pods have (pod `p`'s is `a-{p % APPS}`).
const APPS: usize = 20;

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    a / gcd(a, b) * b
}

/// Pod `p`; `variant` changes its `app` label.
fn pod_yaml(shape: &Shape, p: usize, variant: usize) -> String {
    let (node, ip) = pod_place(shape, p);
    let app = if variant == 0 {
        format!("a-{}", p % APPS)
    } else {
        format!("changed-{variant}")
    };
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: pod-{p}, namespace: ns-{}, labels: {{app: {app}}}}}\n\
         spec: {{nodeName: node-{node}, containers: [{{name: app, image: app}}]}}\n\
         status: {{podIPs: [{{ip: {ip}}}]}}\n",
        p % shape.namespaces
    )
}

fn service_yaml(shape: &Shape, i: usize) -> String {
    let ip = Ipv4Addr::from(0x0a60_0000u32 + 1 + i as u32);
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: svc-{i}, namespace: ns-{}}}\n\
         spec: {{clusterIP: {ip}, clusterIPs: [{ip}], ports: [{{name: http, port: 80, protocol: TCP, targetPort: 8080}}]}}\n",
        i % shape.namespaces
    )
}

/// Service `i`'s EndpointSlice; `extra` endpoints more than the shape's (other pods).
fn slice_yaml(shape: &Shape, i: usize, extra: usize) -> String {
    let mut yaml = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: svc-{i}-1, namespace: ns-{}, labels: {{kubernetes.io/service-name: svc-{i}}}}}\n\
         addressType: IPv4\nports: [{{name: http, port: 8080, protocol: TCP}}]\nendpoints:\n",
        i % shape.namespaces
    );
    for j in 0..shape.endpoints + extra {
        let (node, ip) = pod_place(shape, (i * shape.endpoints + j) % shape.pods);
        let _ = writeln!(
            yaml,
            "- addresses: [{ip}]\n  nodeName: node-{node}\n  conditions: {{ready: true}}"
        );
    }
    yaml
}

/// Policy `k`: its namespace's pods of one app take port 8080 (+ `variant`) from the pods of
/// the next namespace (300 of them in the large cluster).
fn policy_yaml(shape: &Shape, k: usize, variant: usize) -> String {
    let namespace = k % shape.namespaces;
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n\
         metadata: {{name: pol-{k}, namespace: ns-{namespace}}}\n\
         spec: {{podSelector: {{matchLabels: {{app: a-{}}}}}, policyTypes: [Ingress], ingress: [{{\
         from: [{{namespaceSelector: {{matchLabels: {{kubernetes.io/metadata.name: ns-{}}}}}, podSelector: {{matchLabels: {{app: a-{}}}}}}}], \
         ports: [{{protocol: TCP, port: {}}}]}}]}}\n",
        k % APPS,
        (namespace + 1) % shape.namespaces,
        (namespace + 1) % APPS,
        8080 + variant
    )
}

fn firewall_yaml(shape: &Shape, n: usize) -> String {
    let mut yaml = format!(
        "apiVersion: k8s.ovn.org/v1\nkind: EgressFirewall\n\
         metadata: {{name: default, namespace: ns-{n}}}\nspec:\n  egress:\n"
    );
    for r in 0..shape.rules - 1 {
        let _ = writeln!(
            yaml,
            "  - {{type: Allow, to: {{cidrSelector: 198.{}.{r}.0/24}}, ports: [{{protocol: TCP, port: 443}}]}}",
            n % 256
        );
    }
    let _ = writeln!(yaml, "  - {{type: Deny, to: {{cidrSelector: 0.0.0.0/0}}}}");
    yaml
}

/// The agent's state for one cluster over one set of maps.
struct Agent {
    shape: Shape,
    fixture: Fixture,
    objects: ObjectCache,
    /// Versions given to changed objects (each change a new one, so it is parsed again).
    version: u64,
    last: Option<ClusterState>,
    model: Option<NodeModel>,
    /// The overlay maps as the last sync wrote them.
    overlay_written: Option<OverlayMaps>,
    services: ServiceCache,
    lb: LbState,
    /// Every pod as policies select them, patched with each sync's changed pods (as the
    /// agent's sync does).
    policy_pods: PolicyPods,
    /// This node's pods, patched the same way (as the agent's sync does).
    hosted_pods: model::HostedPods,
    /// The egress IP state (the agent's, between syncs).
    egress: EgressNode,
    /// Access control: the agent's own, started at the first sync.
    firewalls: Option<FirewallAgent>,
    hosted_lists: HostedLists,
    /// Its files (DNS cache, audit log, rule names), in a directory of the benchmark's own.
    files: FirewallFiles,
    /// Runs the firewall agent's calls (async, as in the agent).
    runtime: tokio::runtime::Runtime,
    /// While set, events are collected (encoded as the API server sends them) rather than
    /// applied: the first list is encoded before it is timed.
    collected: Option<Vec<Event>>,
}

/// A watch event: resource, namespace, name, and the object as the API server's JSON.
type Event = (&'static str, String, String, String);

/// What one sync took and wrote.
#[derive(Clone, Debug, Default, Serialize)]
struct Step {
    assemble_ms: f64,
    diff_ms: f64,
    stages_ms: f64,
    total_ms: f64,
    stages: Vec<&'static str>,
    writes: usize,
}

impl Agent {
    fn new(shape: Shape) -> anyhow::Result<Self> {
        Ok(Self {
            shape,
            fixture: Fixture::load()?,
            objects: ObjectCache::default(),
            version: 0,
            last: None,
            model: None,
            overlay_written: None,
            services: ServiceCache::default(),
            lb: LbState::default(),
            policy_pods: PolicyPods::default(),
            hosted_pods: model::HostedPods::from_pods(&[], NODE),
            firewalls: None,
            hosted_lists: HostedLists::default(),
            files: bench_files()?,
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?,
            egress: EgressNode::new(NODE, "lo", std::path::PathBuf::from("/nonexistent")),
            collected: None,
        })
    }

    /// One watch event: the object `name` of `kind` (written here as `yaml`), encoded as the
    /// API server sends it (JSON), then applied (or collected, see `collected`).
    fn event(&mut self, kind: &'static str, namespace: &str, name: &str, yaml: String) {
        let value: serde_json::Value = serde_yaml::from_str(&yaml).expect("generated YAML");
        let event = (
            kind,
            namespace.to_owned(),
            name.to_owned(),
            serde_json::to_string(&value).expect("JSON"),
        );
        match &mut self.collected {
            Some(events) => events.push(event),
            None => self.apply(event),
        }
    }

    /// The API source's work on one event: the watcher decodes the JSON into a
    /// `WatchedObject`, the agent decodes that into its type (`kubernetes::parse_watched`),
    /// parsed on its own into the per-object cache.
    fn apply(&mut self, (kind, namespace, name, json): Event) {
        self.version += 1;
        self.objects.put(
            (kind, namespace, name),
            Some(self.version.to_string()),
            || decode(kind, &json),
        );
    }

    /// The first lists as the API source takes them: each resource's watcher decodes its
    /// items as they arrive and hands them to its list's parser (`kubernetes::Listing`, a
    /// thread of its own), the whole list put in the cache once complete
    /// (`ObjectCache::put_listed`).
    fn apply_list(&mut self, events: Vec<Event>) {
        let mut listings: Vec<(&str, Listing)> = Vec::new();
        for (kind, namespace, name, json) in events {
            self.version += 1;
            let version = Some(self.version.to_string());
            let object: WatchedObject = serde_json::from_str(&json).expect("object");
            if listings.last().is_none_or(|(listed, _)| *listed != kind) {
                listings.push((kind, Listing::new(watched(kind))));
            }
            let key = (kind, namespace, name);
            let held = self.objects.holds(&key, version.as_deref());
            if let Some((_, listing)) = listings.last_mut() {
                listing.add(key, version, (!held).then_some(object));
            }
        }
        for (_, listing) in listings {
            self.objects.put_listed(listing.finish().parsed);
        }
    }

    /// Every object of the cluster, as the first lists bring them.
    fn list_everything(&mut self) {
        let s = self.shape;
        self.event("networks", "", "cluster", network_yaml());
        for i in 0..s.nodes {
            self.event("nodes", "", &format!("node-{i}"), node_yaml(i));
        }
        for n in 0..s.namespaces {
            self.event("namespaces", "", &format!("ns-{n}"), namespace_yaml(n));
        }
        for p in 0..s.pods {
            let namespace = format!("ns-{}", p % s.namespaces);
            self.event("pods", &namespace, &format!("pod-{p}"), pod_yaml(&s, p, 0));
        }
        for i in 0..s.services {
            let namespace = format!("ns-{}", i % s.namespaces);
            self.event(
                "services",
                &namespace,
                &format!("svc-{i}"),
                service_yaml(&s, i),
            );
            self.event(
                "endpointslices",
                &namespace,
                &format!("svc-{i}-1"),
                slice_yaml(&s, i, 0),
            );
        }
        for k in 0..s.policies {
            let namespace = format!("ns-{}", k % s.namespaces);
            self.event(
                "networkpolicies",
                &namespace,
                &format!("pol-{k}"),
                policy_yaml(&s, k, 0),
            );
        }
        for n in 0..s.firewalls {
            self.event(
                "egressfirewalls",
                &format!("ns-{n}"),
                "default",
                firewall_yaml(&s, n),
            );
        }
    }

    fn change_endpoint(&mut self, service: usize, extra: usize) {
        let s = self.shape;
        let service = service % s.services;
        let yaml = slice_yaml(&s, service, extra);
        let namespace = format!("ns-{}", service % s.namespaces);
        self.event(
            "endpointslices",
            &namespace,
            &format!("svc-{service}-1"),
            yaml,
        );
    }

    fn change_pod_label(&mut self, pod: usize, variant: usize) {
        let s = self.shape;
        let pod = pod % s.pods;
        let namespace = format!("ns-{}", pod % s.namespaces);
        self.event(
            "pods",
            &namespace,
            &format!("pod-{pod}"),
            pod_yaml(&s, pod, variant),
        );
    }

    fn change_policy(&mut self, policy: usize, variant: usize) {
        let s = self.shape;
        let policy = policy % s.policies;
        let namespace = format!("ns-{}", policy % s.namespaces);
        let yaml = policy_yaml(&s, policy, variant);
        self.event(
            "networkpolicies",
            &namespace,
            &format!("pol-{policy}"),
            yaml,
        );
    }

    /// A new pod `p` (beyond the shape's) on another node, in the namespace and with the
    /// labels the shape gives pod `p`: policies of local pods may have it as a peer.
    fn add_pod(&mut self, p: usize) {
        let s = self.shape;
        let namespace = format!("ns-{}", p % s.namespaces);
        self.event("pods", &namespace, &format!("pod-{p}"), pod_yaml(&s, p, 0));
    }

    /// The `r`-th new pod (on another node) that local pod 1's policy picks as a peer: one
    /// of ns-2 labelled `app: a-2` (policy 1, of ns-1, takes port 8080 from those), so that
    /// both clusters make the same change. A pod's namespace and app follow its index
    /// (`pod_yaml`); at 500 namespaces every pod of a namespace has the same app, while at 50
    /// most new pods were no local pod's peer, and the 10-node cluster's change recompiled
    /// nothing where the large one's recompiled a set of 300 peers.
    fn picked_pod(&self, r: usize) -> usize {
        let period = lcm(self.shape.namespaces, APPS);
        self.shape.pods.div_ceil(period) * period + 2 + r * period
    }

    /// Deletes pod `p` (as a watch's delete event does).
    fn delete_pod(&mut self, p: usize) {
        let namespace = format!("ns-{}", p % self.shape.namespaces);
        self.objects
            .remove(&("pods", namespace, format!("pod-{p}")));
    }

    fn add_node(&mut self, index: usize) {
        self.event("nodes", "", &format!("node-{index}"), node_yaml(index));
    }

    /// A sync as the agent runs it: assemble, diff against the last, the stages that read
    /// what changed (all of them when `full`).
    fn sync(&mut self, full: bool) -> anyhow::Result<Step> {
        let mut step = Step::default();
        let started = Instant::now();
        let state = self.objects.assemble();
        anyhow::ensure!(state.rejected.is_empty(), "{:?}", state.rejected);
        step.assemble_ms = ms(started.elapsed());
        let lap = Instant::now();
        let changes = match &self.last {
            Some(last) if !full => Changes::between(last, &state),
            _ => Changes::full(),
        };
        let mut changes = changes;
        self.hosted_pods.note_changes(&mut changes);
        self.policy_pods.follow(&state, &changes);
        self.hosted_pods.follow(&state, &changes);
        step.diff_ms = ms(lap.elapsed());
        let lap = Instant::now();
        step.stages = changes.stages().iter().map(|s| s.name()).collect();
        if changes.runs(Stage::Overlay) {
            step.writes += self.sync_overlay(&state, full)?;
        }
        if changes.runs(Stage::Services) {
            self.services.update(
                &state.services,
                &state.endpoint_slices,
                &dataplane_user::lb::LocalNode::from_nodes(&state.nodes, NODE),
                &dataplane_user::lb::AddressPolicy::default(),
                &changes,
            );
            let errors = self.services.errors();
            anyhow::ensure!(errors.is_empty(), "{errors:?}");
            let stats = self.services.sync_maps(&mut self.fixture, &mut self.lb)?;
            step.writes += stats.written + stats.deleted;
        }
        if changes.runs(Stage::AccessControl) {
            step.writes += self.sync_access_control(&state, &changes)?;
        }
        if changes.runs(Stage::EgressIps)
            && let Some(model) = &self.model
        {
            // No EgressIP here: what selecting pods for none costs every change.
            let inputs = EgressInputs::from_state(
                &state,
                state.egress_ips.to_vec(),
                &self.policy_pods,
                model,
            );
            self.egress.set_inputs(inputs, None);
            self.egress.apply(&mut self.fixture)?;
        }
        // The multicast plan (no namespace enables it here: what that costs every change).
        if changes.runs(Stage::Multicast)
            && let Some(model) = &self.model
        {
            let plan = multicast::plan(&state, &model.view);
            anyhow::ensure!(plan.pods.is_empty(), "no pod has multicast");
        }
        step.stages_ms = ms(lap.elapsed());
        step.total_ms = ms(started.elapsed());
        self.last = Some(state);
        Ok(step)
    }

    /// The overlay stage: this node's view (its pods behind made-up veths) and the maps.
    fn sync_overlay(&mut self, state: &ClusterState, full: bool) -> anyhow::Result<usize> {
        let network = state.network.unwrap_or_default();
        let settings = network.validate(1500)?;
        let underlay = Underlay {
            ifindex: 1,
            mac: [2, 0, 0, 0, 0, 1],
            xdp_forward: false,
            nodeport_listed: false,
            mtu: 1500,
        };
        let model = model::build(
            state,
            &self.hosted_pods,
            self.model.as_ref(),
            NODE,
            underlay,
            settings,
            local_veth,
        );
        anyhow::ensure!(model.warnings.is_empty(), "{:?}", model.warnings);
        // As the agent does: compiled node by node from what the last sync wrote, and compared
        // with it (a full one compiles from every node and reads the kernel).
        let last = self.overlay_written.take().filter(|_| !full);
        let desired = overlay::compile_since(&model.view, last.as_ref())?;
        let stats = self.fixture.sync_overlay(&desired, last.as_ref())?;
        self.overlay_written = Some(desired);
        self.model = Some(model);
        Ok(stats.written + stats.deleted)
    }

    /// The access-control stage: the agent's firewall agent, given what the agent's sync
    /// gives it.
    fn sync_access_control(
        &mut self,
        state: &ClusterState,
        changes: &Changes,
    ) -> anyhow::Result<usize> {
        let Some(model) = &self.model else {
            anyhow::bail!("no overlay view");
        };
        let inputs = FirewallInputs::from_state(
            state,
            &model.view,
            self.policy_pods.clone(),
            PolicyChanges::from_changes(changes),
            &self.files,
            // The per-object cache's lists, as the API source's.
            true,
            &mut self.hosted_lists,
        );
        let written = match &mut self.firewalls {
            Some(firewalls) => {
                let updated = self
                    .runtime
                    .block_on(firewalls.update(&mut self.fixture, inputs))?;
                updated.stats.written + updated.stats.deleted
            }
            None => {
                let (started, stats) = self
                    .runtime
                    .block_on(FirewallAgent::start(&mut self.fixture, inputs))?;
                self.firewalls = Some(started);
                stats.written + stats.deleted
            }
        };
        let firewalls = self.firewalls.as_ref().expect("started");
        anyhow::ensure!(
            firewalls.rejected() == (0, 0, 0),
            "rejected {:?}",
            firewalls.rejected()
        );
        Ok(written)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(dir) = self.files.dns_cache.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A directory of this run's own for access control's files, in memory as the agent's run
/// directory is on a node (`/run/dataplane`, a tmpfs): on this machine's ext4 `/tmp`, replacing
/// the rules' description by a rename made the file system flush it, 0.6 ms a change.
fn bench_files() -> anyhow::Result<FirewallFiles> {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let memory = Path::new("/dev/shm");
    let parent = if memory.is_dir() {
        memory.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let dir = parent.join(format!("scale-bench-{}-{run}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(FirewallFiles {
        dns_server: None,
        dns_cache: dir.join("dns-cache.json"),
        audit_path: dir.join("audit.log"),
        rules_dir: dir.join("acl-rules"),
    })
}

/// One watched object of resource `kind` from the API server's JSON, as the agent's
/// watchers decode it and the agent parses it.
fn decode(kind: &str, json: &str) -> ClusterState {
    let object: WatchedObject = serde_json::from_str(json).expect("object");
    let watched = watched(kind);
    parse_watched(kind, &watched.api_version(), watched.kind, object)
}

/// The watched resource `kind` (its plural).
fn watched(kind: &str) -> Watched {
    Watched::by_resource(kind).expect("a watched resource")
}

/// This node's pods are behind made-up veths (the maps take any interface index).
fn local_veth(ip: IpAddr) -> Option<HostInterface> {
    let IpAddr::V4(v4) = ip else {
        return None;
    };
    let [a, b, c, d] = v4.octets();
    ([a, b, c] == node_subnet(0)).then(|| HostInterface {
        name: format!("veth{d}"),
        ifindex: 1000 + u32::from(d),
        mac: [2, 0, 0, 0, 1, d],
        // No such devices: the device map refuses them.
        takes_xdp: false,
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

fn percentile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    let index = ((values.len() as f64 - 1.0) * p).round() as usize;
    values.get(index).copied().unwrap_or(f64::NAN)
}

/// One kind of change, its median time from event to maps written, and its last step.
#[derive(Clone, Debug, Serialize)]
struct Change {
    what: &'static str,
    median_ms: f64,
    /// The median of this change's time over the small cluster's, block by block.
    ratio: f64,
    last: Step,
}

/// Changes timed in one cluster before the other's turn (see [`changes`]).
const BLOCK: usize = 10;

/// Each single change `repeats` times (toggling back and forth) in the large cluster and in
/// the small one, by turns in blocks of [`BLOCK`] changes, so that both are timed in the
/// same minute of the machine: its load moved the small cluster's changes between 0.1 and
/// 0.6 ms from one minute to the next, more than the code did, when each cluster ran all its
/// changes apart. Blocks rather than single changes by turns: right after the large
/// cluster's change the small one's state is out of the caches, which made its changes
/// twice as slow as when they follow each other (as they do in a small cluster's agent).
/// Each kind's ratio is the median of the blocks' ratios (of their medians).
fn changes(
    large: &mut Agent,
    small: &mut Agent,
    repeats: usize,
    only: Option<&str>,
) -> anyhow::Result<(Vec<Change>, Vec<Change>)> {
    let (mut out_large, mut out_small) = (Vec::new(), Vec::new());
    type Apply = fn(&mut Agent, usize);
    let kinds: [(&'static str, Apply); 5] = [
        ("one endpoint added or removed", |a, r| {
            a.change_endpoint(0, (r + 1) % 2)
        }),
        ("one local pod's label", |a, r| {
            a.change_pod_label(0, (r + 1) % 2)
        }),
        // Policy 1 selects local pod 1 (app a-1 in ns-1), whose labels stay.
        ("one NetworkPolicy's port", |a, r| {
            a.change_policy(1, (r + 1) % 2)
        }),
        ("one pod added on another node", |a, r| {
            let p = a.picked_pod(r);
            a.add_pod(p);
        }),
        ("one node added", |a, r| {
            let index = a.shape.nodes + r;
            a.add_node(index);
        }),
    ];
    for (what, apply) in kinds
        .into_iter()
        .filter(|(what, _)| only.is_none_or(|o| what.contains(o)))
    {
        let (mut times_large, mut times_small, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        let (mut last_large, mut last_small) = (Step::default(), Step::default());
        for start in (0..repeats).step_by(BLOCK) {
            let block = start..(start + BLOCK).min(repeats);
            let (mut block_large, mut block_small) = (Vec::new(), Vec::new());
            for r in block.clone() {
                let (elapsed, step) = timed_change(large, apply, r)?;
                block_large.push(elapsed);
                last_large = step;
            }
            for r in block {
                let (elapsed, step) = timed_change(small, apply, r)?;
                block_small.push(elapsed);
                last_small = step;
            }
            times_large.extend(&block_large);
            times_small.extend(&block_small);
            ratios.push(median(block_large) / median(block_small).max(1e-6));
        }
        let ratio = median(ratios);
        out_large.push(Change {
            what,
            median_ms: median(times_large),
            ratio,
            last: last_large,
        });
        out_small.push(Change {
            what,
            median_ms: median(times_small),
            ratio: 1.0,
            last: last_small,
        });
    }
    Ok((out_large, out_small))
}

/// One change made by `apply` in `agent`'s cluster: the event as the API server sends it,
/// timed from its arrival to the maps written.
fn timed_change(
    agent: &mut Agent,
    apply: fn(&mut Agent, usize),
    r: usize,
) -> anyhow::Result<(f64, Step)> {
    agent.collected = Some(Vec::new());
    apply(agent, r);
    let events = agent.collected.take().unwrap_or_default();
    let profiled = std::env::var_os("PERF_FIRST").is_none()
        && std::env::var("PERF_NODES").map_or(true, |n| n == agent.shape.nodes.to_string());
    if profiled {
        perf_ctl("enable");
    }
    let started = Instant::now();
    for event in events {
        agent.apply(event);
    }
    let step = agent.sync(false)?;
    let elapsed = ms(started.elapsed());
    if profiled {
        perf_ctl("disable");
    }
    Ok((elapsed, step))
}

/// The stream: `rate` changes a second for `seconds`, by turns an endpoint, a pod's labels,
/// and a pod added or deleted on another node; the agent syncs whatever arrived since its
/// last sync. Returns each change's lag and whether a full recompute at the end finds the
/// maps as they should be.
#[derive(Clone, Debug, Serialize)]
struct Stream {
    changes: usize,
    syncs: usize,
    lag_p50_ms: f64,
    lag_p99_ms: f64,
    /// Entries a full recompute at the end wrote (0: the maps held the cluster state).
    full_recompute_writes: usize,
}

fn stream(agent: &mut Agent, rate: u64, seconds: u64) -> anyhow::Result<Stream> {
    let total = (rate * seconds) as usize;
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let started = Instant::now();
    let mut next = 0usize;
    let mut lags = Vec::with_capacity(total);
    let mut syncs = 0;
    let mut churned = std::collections::BTreeSet::new();
    while next < total {
        let now = started.elapsed();
        let due = ((now.as_secs_f64() / interval.as_secs_f64()) as usize + 1).min(total);
        if due <= next {
            std::thread::sleep(interval.saturating_mul(next as u32).saturating_sub(now));
            continue;
        }
        let arrivals: Vec<Duration> = (next..due).map(|k| interval * k as u32).collect();
        for k in next..due {
            let turn = k / 3;
            match k % 3 {
                0 => agent.change_endpoint(turn, (turn / agent.shape.services) % 2 + 1),
                1 => agent.change_pod_label(turn, turn / agent.shape.pods + 1),
                // Pods come and go on other nodes: 100 of them, each added then deleted.
                _ => {
                    let p = agent.shape.pods + turn % 100;
                    if churned.insert(p) {
                        agent.add_pod(p);
                    } else {
                        churned.remove(&p);
                        agent.delete_pod(p);
                    }
                }
            }
        }
        next = due;
        agent.sync(false)?;
        syncs += 1;
        let done = started.elapsed();
        lags.extend(arrivals.iter().map(|a| ms(done.saturating_sub(*a))));
    }
    // A full recompute from the same objects: the services compiled anew, access control's
    // pods all compiled again (its full sync, as the agent's).
    agent.services = ServiceCache::default();
    let full = agent.sync(true)?;
    Ok(Stream {
        changes: total,
        syncs,
        lag_p50_ms: percentile(&mut lags, 0.5),
        lag_p99_ms: percentile(&mut lags, 0.99),
        full_recompute_writes: full.writes,
    })
}

/// Resident memory of this process, in bytes.
fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Kernel memory of the BPF maps this process holds open: `memlock` of each map descriptor's
/// fdinfo.
fn map_memlock_bytes() -> u64 {
    let Ok(fds) = std::fs::read_dir("/proc/self/fdinfo") else {
        return 0;
    };
    fds.filter_map(Result::ok)
        .filter_map(|entry| std::fs::read_to_string(entry.path()).ok())
        .filter(|info| info.contains("map_type:"))
        .filter_map(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("memlock:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .sum()
}

#[derive(Serialize)]
struct Report {
    shape: Shape,
    parse_ms: f64,
    initial: Step,
    changes: Vec<Change>,
    small_changes: Vec<Change>,
    stream: Stream,
    resident_mib: f64,
    map_memlock_mib: f64,
}

fn main() -> anyhow::Result<()> {
    // As the agent's main does: its first sync is what this measures.
    dataplane_user::small_pages_only()?;
    let args = Args::parse();
    let (shape, repeats, rate, seconds) = if args.smoke {
        (SMOKE, 1, 100, 1)
    } else {
        (LARGE, args.repeats, args.stream_rate, args.stream_seconds)
    };
    let mut agent = Agent::new(shape)?;
    // The first lists as the API server would send them, then their decode timed.
    agent.collected = Some(Vec::new());
    agent.list_everything();
    let mut listed = agent.collected.take().unwrap_or_default();
    // Each resource's list in the API server's order: by key (etcd's), namespace then name.
    listed.sort_by(|a, b| (a.0, &a.1, &a.2).cmp(&(b.0, &b.1, &b.2)));
    let profiled = std::env::var_os("PERF_FIRST").is_some();
    if profiled {
        perf_ctl("enable");
    }
    let started = Instant::now();
    agent.apply_list(listed);
    let parse_ms = ms(started.elapsed());
    let initial = agent.sync(true)?;
    if profiled {
        perf_ctl("disable");
    }
    // The 10-node cluster beside it, each change timed in both by turns.
    let mut small = Agent::new(SMALL)?;
    small.list_everything();
    small.sync(true)?;
    let (changes, small_changes) = changes(&mut agent, &mut small, repeats, args.only.as_deref())?;
    drop(small);
    let stream = stream(&mut agent, rate, seconds)?;
    let resident_mib = resident_bytes() as f64 / (1 << 20) as f64;
    let map_memlock_mib = map_memlock_bytes() as f64 / (1 << 20) as f64;
    drop(agent);
    let report = Report {
        shape,
        parse_ms,
        initial,
        changes,
        small_changes,
        stream,
        resident_mib,
        map_memlock_mib,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    print(&report);
    Ok(())
}

fn print(report: &Report) {
    let s = &report.shape;
    println!(
        "scale: {} nodes, {} pods ({} here), {} services x {} endpoints, {} NetworkPolicies, {} EgressFirewalls x {} rules",
        s.nodes, s.pods, s.local_pods, s.services, s.endpoints, s.policies, s.firewalls, s.rules
    );
    let i = &report.initial;
    println!(
        "  first sync from nothing: {:.0} ms (target < 2000): decoding every object from the API's JSON {:.0} ms, then assemble {:.0}, stages {:.0} ({} entries)",
        report.parse_ms + i.total_ms,
        report.parse_ms,
        i.assemble_ms,
        i.stages_ms,
        i.writes
    );
    for (big, small) in report.changes.iter().zip(&report.small_changes) {
        println!(
            "  {}: {:.1} ms (target < 10; assemble {:.1}, diff {:.1}, stages {:?} {:.1}, {} writes) vs {:.2} ms with 10 nodes: ratio {:.1} (target <= 2; the median of blocks timed by turns)",
            big.what,
            big.median_ms,
            big.last.assemble_ms,
            big.last.diff_ms,
            big.last.stages,
            big.last.stages_ms,
            big.last.writes,
            small.median_ms,
            big.ratio
        );
    }
    let st = &report.stream;
    println!(
        "  stream of {} changes: {} syncs, lag p50 {:.0} ms, p99 {:.0} ms (target < 100); a full recompute after it wrote {} entries (0: the maps held the cluster)",
        st.changes, st.syncs, st.lag_p50_ms, st.lag_p99_ms, st.full_recompute_writes
    );
    println!(
        "  resident memory {:.0} MiB (target < 1024; the agent's state and the benchmark's objects), maps' kernel memory {:.0} MiB (memlock)",
        report.resident_mib, report.map_memlock_mib
    );
}

fn perf_ctl(what: &str) {
    use std::io::{Read, Write};
    let (Ok(ctl), Ok(ack)) = (std::env::var("PERF_CTL"), std::env::var("PERF_ACK")) else {
        return;
    };
    let mut c = std::fs::OpenOptions::new().write(true).open(ctl).unwrap();
    c.write_all(format!("{what}\n").as_bytes()).unwrap();
    let mut a = std::fs::File::open(ack).unwrap();
    let mut buf = [0u8; 5];
    let _ = a.read(&mut buf);
}
