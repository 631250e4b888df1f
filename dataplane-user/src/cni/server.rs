//! The agent's side of the plugin: the unix socket, and the pods it wires.
//!
//! Requests are queued to the agent's serving loop (which owns the maps) as [`Job`]s. The loop
//! allocates and wires every ADD of a batch, syncs the maps once with the new pods in the
//! cluster state ([`CniPods::merge_into`], as [`status::merge`] says),
//! attaches the programs, and only then answers. An ADD the sync could not install is undone
//! and fails: no pod runs with an unpoliced interface.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
};

use ipnet::IpNet;
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::UnixListener,
    sync::{mpsc, oneshot},
};

use super::{
    ipam::{Allocation, Ipam, IpamError, PodRef},
    protocol::{REQUEST_MAX, Reply, Request, Target},
    spec::{Attachment, CniError, code},
    status::{self, PodStatusRecord},
    wire::{self, PodWiring},
};
use crate::{kernel::netdev, model, source::ClusterState};

/// One request from the plugin and where its answer goes.
pub struct Job {
    pub request: Request,
    /// When the request reached the agent.
    pub received: std::time::Instant,
    reply: oneshot::Sender<Reply>,
}

impl Job {
    pub fn answer(self, reply: Reply) {
        // A plugin that gave up waiting has nobody to read the answer.
        let _ = self.reply.send(reply);
    }

    /// The command's name, as the specification spells it.
    pub fn command(&self) -> &'static str {
        match self.request {
            Request::Add(_) => "ADD",
            Request::Del(_) => "DEL",
            Request::Check(_) => "CHECK",
            Request::Status => "STATUS",
            Request::Gc(_) => "GC",
        }
    }
}

/// Listens at `path` (a stale socket of an earlier agent is replaced); only root may connect.
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Requests served at once (the rest wait in the socket's backlog): a runtime runs one
/// plugin per pod being set up or torn down, and a node runs a few hundred pods.
pub const CONNECTIONS_MAX: usize = 512;

/// Accepts connections for ever, each read as one request and queued to `jobs`.
pub async fn accept(listener: UnixListener, jobs: mpsc::UnboundedSender<Job>) {
    let room = std::sync::Arc::new(tokio::sync::Semaphore::new(CONNECTIONS_MAX));
    loop {
        let Ok(permit) = std::sync::Arc::clone(&room).acquire_owned().await else {
            return;
        };
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                tracing::warn!(%error, "accepting a CNI connection");
                continue;
            }
        };
        let jobs = jobs.clone();
        tokio::spawn(async move {
            if let Err(error) = serve_one(stream, jobs).await {
                tracing::warn!(%error, "serving a CNI request");
            }
            drop(permit);
        });
    }
}

/// How long a client may take to send its whole request: the plugin writes it at once.
pub const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Reads one request: from root only (the plugin runs as root, as runtimes run plugins), at
/// most [`REQUEST_MAX`] bytes, whole within [`REQUEST_TIMEOUT`].
async fn read_request(stream: &mut tokio::net::UnixStream) -> Result<Vec<u8>, CniError> {
    let peer = stream.peer_cred().map_err(|e| {
        CniError::new(
            code::INVALID_ENVIRONMENT,
            format!("reading the peer's credentials: {e}"),
        )
    })?;
    // One deadline for the whole request, refused or not.
    let deadline = tokio::time::Instant::now() + REQUEST_TIMEOUT;
    if peer.uid() != 0 {
        // Not kept, only drained: a socket closed with unread data resets, and the client
        // would lose the answer saying why.
        drain(stream, deadline).await;
        return Err(CniError::new(
            code::INVALID_ENVIRONMENT,
            format!("only root may ask the agent (uid {} asked)", peer.uid()),
        ));
    }
    let mut text = Vec::new();
    let limit = u64::try_from(REQUEST_MAX).unwrap_or(u64::MAX) + 1;
    let read =
        tokio::time::timeout_at(deadline, (&mut *stream).take(limit).read_to_end(&mut text)).await;
    let refusal = match read {
        Err(_) => CniError::new(
            code::DECODE_FAILURE,
            format!("the request did not arrive whole within {REQUEST_TIMEOUT:?}"),
        ),
        Ok(Err(error)) => CniError::new(code::IO_FAILURE, format!("reading the request: {error}")),
        Ok(Ok(_)) if text.len() > REQUEST_MAX => {
            drain(stream, deadline).await;
            CniError::new(
                code::DECODE_FAILURE,
                format!("the request is larger than {REQUEST_MAX} bytes"),
            )
        }
        Ok(Ok(_)) => return Ok(text),
    };
    Err(refusal)
}

/// Reads and discards what the client still sends, until it stops or `deadline` passes.
async fn drain(stream: &mut tokio::net::UnixStream, deadline: tokio::time::Instant) {
    let _ =
        tokio::time::timeout_at(deadline, tokio::io::copy(stream, &mut tokio::io::sink())).await;
}

async fn serve_one(
    mut stream: tokio::net::UnixStream,
    jobs: mpsc::UnboundedSender<Job>,
) -> std::io::Result<()> {
    let request = read_request(&mut stream).await.and_then(|text| {
        let request = serde_json::from_slice::<Request>(&text).map_err(|error| {
            CniError::new(
                code::DECODE_FAILURE,
                format!(
                    "the agent could not read the plugin's request ({error}); are the plugin and the agent of the same release?"
                ),
            )
        })?;
        request.check_names()?;
        Ok(request)
    });
    let reply = match request {
        Ok(request) => {
            let (reply, answer) = oneshot::channel();
            let received = std::time::Instant::now();
            if jobs
                .send(Job {
                    request,
                    received,
                    reply,
                })
                .is_err()
            {
                return Ok(());
            }
            match answer.await {
                Ok(reply) => reply,
                Err(_) => return Ok(()),
            }
        }
        Err(error) => {
            tracing::warn!(%error, "CNI request refused");
            Reply::Failed(error)
        }
    };
    let text = serde_json::to_vec(&reply).expect("a reply serializes");
    stream.write_all(&text).await?;
    stream.shutdown().await
}

/// A Pod object scheduled on this node, as the CNI needs it.
#[derive(Clone, Debug)]
pub struct KnownPod {
    pub uid: String,
    /// The addresses its manifest names (manifest mode only): it gets these.
    pub own_addresses: Vec<IpAddr>,
    /// Its MAC when OVN-Kubernetes' annotation names one.
    pub mac: Option<[u8; 6]>,
}

/// What the last good sync says about this node, for the CNI.
#[derive(Clone, Debug, Default)]
pub struct NodePods {
    /// The node's `spec.podCIDRs`.
    pub pools: Vec<IpNet>,
    pub pod_mtu: u32,
    /// By (namespace, name).
    pub known: BTreeMap<(String, String), KnownPod>,
    /// Namespaces whose pods get no interface, with why (labelled for a primary
    /// user-defined network: `api::userdefinednetwork::unwired_namespace`).
    pub unwired_namespaces: BTreeMap<String, String>,
}

impl NodePods {
    /// This node's pools and Pod objects (those of `pods` on `node`). `own_addresses` says whether a Pod's
    /// `status.podIPs` are its own to keep (a manifest directory) or the last sandbox's (the
    /// API server: a new sandbox gets new addresses).
    pub fn from_pods<'a>(
        pods: impl IntoIterator<Item = &'a std::sync::Arc<crate::source::Pod>>,
        node: &str,
        pools: Vec<IpNet>,
        pod_mtu: u32,
        own_addresses: bool,
    ) -> Self {
        let mut known = BTreeMap::new();
        for pod in pods {
            if !model::runs_on(pod, node) {
                continue;
            }
            let mut ignored = Vec::new();
            let addresses = if own_addresses {
                model::pod_addresses(pod, &mut ignored)
            } else {
                Vec::new()
            };
            let mac = pod
                .metadata
                .annotations
                .as_ref()
                .is_some_and(|a| a.contains_key(model::POD_NETWORKS_ANNOTATION))
                .then(|| model::pod_mac(pod, &addresses, &mut ignored))
                .flatten();
            known.insert(
                (
                    pod.metadata
                        .namespace
                        .clone()
                        .unwrap_or_else(|| "default".into()),
                    pod.metadata.name.clone().unwrap_or_default(),
                ),
                KnownPod {
                    uid: pod.metadata.uid.clone().unwrap_or_default(),
                    own_addresses: addresses,
                    mac,
                },
            );
        }
        Self {
            pools,
            pod_mtu,
            known,
            unwired_namespaces: BTreeMap::new(),
        }
    }

    /// Refuses the pods of these namespaces, each with its reason.
    pub fn unwiring(mut self, namespaces: BTreeMap<String, String>) -> Self {
        self.unwired_namespaces = namespaces;
        self
    }

    /// Why the pod gets no interface, if it does not.
    fn refusal(&self, pod: Option<&PodRef>) -> Option<CniError> {
        let why = self.unwired_namespaces.get(&pod?.namespace)?;
        Some(CniError::new(code::NO_PRIMARY_NETWORK, why.clone()))
    }

    /// Addresses that manifests give their own pods: never allocated to another.
    fn reserved(&self) -> Vec<IpAddr> {
        self.known
            .values()
            .flat_map(|p| p.own_addresses.iter().copied())
            .collect()
    }

    fn known(&self, pod: Option<&PodRef>) -> Option<&KnownPod> {
        let pod = pod?;
        self.known
            .get(&(pod.namespace.clone(), pod.name.clone()))
            .filter(|k| pod.uid.is_empty() || k.uid.is_empty() || k.uid == pod.uid)
    }

    fn mac(&self, pod: Option<&PodRef>, addresses: &[IpAddr]) -> Option<[u8; 6]> {
        self.known(pod)
            .and_then(|k| k.mac)
            .or_else(|| model::derived_pod_mac(addresses))
    }
}

/// How many pods a batch of ADDs wires at once.
const WIRING_THREADS: usize = 16;

/// Wires the prepared pods that need it, a thread each; `None` for those that need none.
fn wire_side_by_side(
    prepared: &[Result<Prepared, CniError>],
) -> Vec<Option<Result<(), wire::WireError>>> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = prepared
            .iter()
            .map(|prepared| match prepared {
                Ok(p) if !p.wired => Some(scope.spawn(|| wire::create(&p.wiring, &p.netns))),
                _ => None,
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| {
                handle.map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(wire::WireError::Mismatch(
                            "the wiring thread panicked".into(),
                        ))
                    })
                })
            })
            .collect()
    })
}

/// An ADD between its address allocation and its wiring.
struct Prepared {
    allocated: Allocation,
    wiring: PodWiring,
    netns: std::fs::File,
    /// Already wired as it should be (a retried ADD).
    wired: bool,
}

/// The pods this agent wired, kept by their address allocations.
pub struct CniPods {
    ipam: Ipam,
    /// Where runtimes keep named pod network namespaces (besides `/proc/<pid>/ns/net`).
    netns_dirs: Vec<PathBuf>,
}

impl CniPods {
    pub fn open(ipam_file: &Path) -> Result<Self, IpamError> {
        Ok(Self {
            ipam: Ipam::open(ipam_file)?,
            netns_dirs: wire::DEFAULT_NETNS_DIRS.iter().map(PathBuf::from).collect(),
        })
    }

    /// Takes pod network namespaces from `dirs` (and `/proc/<pid>/ns/net`) only.
    pub fn with_netns_dirs(mut self, dirs: Vec<PathBuf>) -> Self {
        self.netns_dirs = dirs;
        self
    }

    /// The pod's network namespace, opened and checked: a namespace the agent may not wire
    /// is the runtime's error, named.
    fn open_netns(&self, netns: &str) -> Result<std::fs::File, CniError> {
        wire::open_pod_netns(Path::new(netns), &self.netns_dirs).map_err(netns_error)
    }

    /// Allocates the pod's addresses (or takes those its manifest names) and wires it. The
    /// maps are not touched: the caller syncs, then answers.
    pub fn add(&mut self, target: &Target, node: &NodePods) -> Result<Attachment, CniError> {
        self.add_many(std::slice::from_ref(target), node)
            .pop()
            .expect("one result for one target")
    }

    /// [`Self::add`] for several pods: their addresses are allocated one after the other, then
    /// they are wired side by side (each wiring is some twenty netlink requests and a few
    /// namespace switches, most of it waiting), each result in the targets' order.
    pub fn add_many(
        &mut self,
        targets: &[Target],
        node: &NodePods,
    ) -> Vec<Result<Attachment, CniError>> {
        let prepared: Vec<Result<Prepared, CniError>> = targets
            .iter()
            .map(|target| self.prepare(target, node))
            .collect();
        // At most WIRING_THREADS at a time: a burst of ADDs never costs a thread each.
        let wired: Vec<Option<Result<(), wire::WireError>>> = prepared
            .chunks(WIRING_THREADS)
            .flat_map(wire_side_by_side)
            .collect();
        prepared
            .into_iter()
            .zip(wired)
            .zip(targets)
            .map(|((prepared, wired), target)| {
                let prepared = prepared?;
                if let Some(Err(error)) = wired {
                    let _ = self.ipam.release(&target.container_id, &target.ifname);
                    let code = match error {
                        wire::WireError::Netns { .. } => code::UNKNOWN_CONTAINER,
                        _ => code::WIRING_FAILED,
                    };
                    return Err(CniError::new(code, format!("wiring the pod: {error}")));
                }
                Ok(attachment(&prepared.allocated, &prepared.wiring))
            })
            .collect()
    }

    /// An ADD's checks and address allocation, and the wiring it needs (`wired`: a runtime
    /// retrying ADD of a pod wired as it should be, which is left be).
    fn prepare(&mut self, target: &Target, node: &NodePods) -> Result<Prepared, CniError> {
        target.check_names()?;
        if let Some(refused) = node.refusal(target.pod.as_ref()) {
            return Err(refused);
        }
        let netns_path = target.netns.clone().ok_or_else(|| {
            CniError::new(code::INVALID_ENVIRONMENT, "CNI_NETNS is required for ADD")
        })?;
        // Opened and checked before anything is allocated: a refused ADD leaves no trace.
        let netns = self.open_netns(&netns_path)?;
        let retried = self
            .ipam
            .get(&target.container_id, &target.ifname)
            .is_some();
        let own = node
            .known(target.pod.as_ref())
            .map(|k| k.own_addresses.clone())
            .unwrap_or_default();
        let allocated = if own.is_empty() {
            self.ipam.allocate(
                &node.pools,
                &node.reserved(),
                &target.container_id,
                &target.ifname,
                target.pod.clone(),
            )
        } else {
            self.ipam.claim(
                &node.pools,
                &own,
                &target.container_id,
                &target.ifname,
                target.pod.clone(),
            )
        }
        .map_err(ipam_error)?;
        let wiring = match wiring(&allocated, &netns_path, node) {
            Ok(wiring) => wiring,
            Err(error) => {
                if !retried {
                    let _ = self.ipam.release(&target.container_id, &target.ifname);
                }
                return Err(error);
            }
        };
        let wired = retried && wire::check(&wiring, &netns).is_ok();
        Ok(Prepared {
            allocated,
            wiring,
            netns,
            wired,
        })
    }

    /// Removes the pod's wiring and releases its addresses; nothing to remove is success.
    pub fn del(&mut self, container_id: &str, ifname: &str) -> Result<bool, CniError> {
        let done = self.del_many(&[(container_id.to_owned(), ifname.to_owned())])?;
        Ok(done[0])
    }

    /// [`Self::del`] for several container interfaces at once: their veths go in one kernel
    /// operation (see [`wire::remove_many`]), then their addresses are released. Says for
    /// each whether there was anything to remove.
    pub fn del_many(&mut self, targets: &[(String, String)]) -> Result<Vec<bool>, CniError> {
        let removed = remove_veths(targets);
        self.release(targets, removed)
    }

    /// The second half of [`Self::del_many`], after [`remove_veths`] (which may run on another
    /// thread, the kernel taking tens of milliseconds to unregister devices): releases the
    /// targets' addresses once their veths are gone. Says for each whether there was anything
    /// to remove.
    pub fn release(
        &mut self,
        targets: &[(String, String)],
        removed: Result<Vec<String>, CniError>,
    ) -> Result<Vec<bool>, CniError> {
        let removed = removed?;
        let mut done = Vec::new();
        for (id, ifname) in targets {
            let released = self.ipam.release(id, ifname).map_err(ipam_error)?;
            let host = wire::host_iface_name(id, ifname);
            done.push(removed.contains(&host) || released.is_some());
        }
        Ok(done)
    }

    /// Checks the pod's wiring against its allocation.
    pub fn check(&self, target: &Target, node: &NodePods) -> Result<Attachment, CniError> {
        target.check_names()?;
        let Some(allocated) = self.ipam.get(&target.container_id, &target.ifname) else {
            return Err(CniError::new(
                code::UNKNOWN_CONTAINER,
                format!(
                    "no attachment of container {} interface {} on this node",
                    target.container_id, target.ifname
                ),
            ));
        };
        let netns_path = target.netns.clone().ok_or_else(|| {
            CniError::new(code::INVALID_ENVIRONMENT, "CNI_NETNS is required for CHECK")
        })?;
        let netns = self.open_netns(&netns_path)?;
        let wiring = wiring(allocated, &netns_path, node)?;
        wire::check(&wiring, &netns)
            .map_err(|e| CniError::new(code::CHECK_FAILED, e.to_string()))?;
        Ok(attachment(allocated, &wiring))
    }

    /// Releases every attachment not in `valid` and removes its veth; returns how many.
    pub fn gc(&mut self, valid: &[(String, String)]) -> Result<usize, CniError> {
        let valid: BTreeSet<(String, String)> = valid.iter().cloned().collect();
        let released = self.ipam.gc(&valid).map_err(ipam_error)?;
        let hosts: Vec<String> = released
            .iter()
            .map(|a| wire::host_iface_name(&a.container_id, &a.ifname))
            .collect();
        if let Err(error) = wire::remove_many(&hosts) {
            tracing::warn!(?hosts, %error, "removing stale pod veths");
        }
        for stale in &released {
            tracing::info!(
                container = stale.container_id,
                addresses = ?stale.addresses,
                "CNI GC released a stale attachment"
            );
        }
        Ok(released.len())
    }

    /// The attachments of this node as pod status records.
    pub fn status_records(&self, node: &str) -> Vec<PodStatusRecord> {
        self.ipam
            .allocations()
            .filter_map(|a| {
                let pod = a.pod.as_ref()?;
                Some(PodStatusRecord {
                    namespace: pod.namespace.clone(),
                    name: pod.name.clone(),
                    uid: pod.uid.clone(),
                    node: node.to_owned(),
                    addresses: a.addresses.iter().map(IpNet::addr).collect(),
                })
            })
            .collect()
    }

    /// Puts the attachments' pods into `state` (see [`status::merge`]).
    pub fn merge_into(&self, state: &mut ClusterState, node: &str) {
        status::merge(state, &self.status_records(node));
    }
}

/// The wiring of an allocation; an allocation without an address (a damaged state file
/// the IPAM let through) is an error, never a panic of the agent's loop.
/// Removes the veths of `targets` (container id, interface name) in one kernel operation;
/// returns the host-side names of those there were. Blocking, bounded by the netlink
/// deadline; touches no agent state, so it may run off the agent's loop.
pub fn remove_veths(targets: &[(String, String)]) -> Result<Vec<String>, CniError> {
    let hosts: Vec<String> = targets
        .iter()
        .map(|(id, ifname)| wire::host_iface_name(id, ifname))
        .collect();
    wire::remove_many(&hosts).map_err(|e| {
        CniError::new(
            code::TRY_AGAIN_LATER,
            format!("removing the pods' veths: {e}"),
        )
    })
}

fn wiring(allocated: &Allocation, netns: &str, node: &NodePods) -> Result<PodWiring, CniError> {
    let addresses: Vec<IpAddr> = allocated.addresses.iter().map(IpNet::addr).collect();
    let mac = node
        .mac(allocated.pod.as_ref(), &addresses)
        .ok_or_else(|| {
            CniError::new(
                code::IO_FAILURE,
                format!(
                    "the address allocation of container {} interface {} holds no address",
                    allocated.container_id, allocated.ifname
                ),
            )
        })?;
    Ok(PodWiring {
        host_iface: wire::host_iface_name(&allocated.container_id, &allocated.ifname),
        ifname: allocated.ifname.clone(),
        netns: PathBuf::from(netns),
        mac,
        addresses,
        mtu: node.pod_mtu,
    })
}

fn attachment(allocated: &Allocation, wiring: &PodWiring) -> Attachment {
    Attachment {
        host_mac: netdev::mac(&wiring.host_iface)
            .map(|m| netdev::mac_text(&m))
            .unwrap_or_default(),
        host_iface: wiring.host_iface.clone(),
        ifname: wiring.ifname.clone(),
        pod_mac: netdev::mac_text(&wiring.mac),
        netns: wiring.netns.display().to_string(),
        addresses: allocated
            .addresses
            .iter()
            .map(|a| IpNet::from(a.addr()))
            .collect(),
        mtu: wiring.mtu,
    }
}

/// A namespace refused is the runtime's error; one that cannot be opened is a container
/// that is gone.
fn netns_error(error: wire::WireError) -> CniError {
    let code = match &error {
        wire::WireError::Netns { source, .. }
            if source.kind() == std::io::ErrorKind::PermissionDenied =>
        {
            code::INVALID_ENVIRONMENT
        }
        _ => code::UNKNOWN_CONTAINER,
    };
    CniError::new(code, format!("CNI_NETNS: {error}"))
}

fn ipam_error(error: IpamError) -> CniError {
    let code = match error {
        IpamError::Exhausted { .. } => code::POOL_EXHAUSTED,
        IpamError::NoPool => code::TRY_AGAIN_LATER,
        IpamError::Held { .. } | IpamError::OutsidePools { .. } => code::INVALID_CONFIG,
        IpamError::State { .. } => code::IO_FAILURE,
    };
    let advice = match error {
        IpamError::Exhausted { .. } => {
            "; delete pods on this node, or give nodes larger pod CIDRs (the Network's clusterNetwork hostPrefix)"
        }
        IpamError::NoPool => "; the node's pod CIDRs are not known yet: try again later",
        _ => "",
    };
    CniError::new(
        code,
        format!("allocating the pod's addresses: {error}{advice}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(id: &str) -> Target {
        Target {
            container_id: id.into(),
            netns: Some("/run/netns/dataplane-unit-test-absent".into()),
            ifname: "eth0".into(),
            pod: None,
        }
    }

    #[test]
    fn a_full_pool_is_a_clear_error_and_never_a_duplicate() {
        let dir = std::env::temp_dir().join(format!("cni-pool-{}", std::process::id()));
        let mut pods = CniPods::open(&dir.join("ipam.json")).unwrap();
        let node = NodePods {
            // A /30: the network, the gateway and the broadcast address leave one.
            pools: vec!["10.244.9.0/30".parse().unwrap()],
            pod_mtu: 1400,
            known: BTreeMap::new(),
            unwired_namespaces: BTreeMap::new(),
        };
        // The one address is taken; the next allocation fails, as an ADD says it.
        pods.ipam
            .allocate(&node.pools, &[], "holder", "eth0", None)
            .unwrap();
        let full = ipam_error(
            pods.ipam
                .allocate(&node.pools, &[], "second", "eth0", None)
                .unwrap_err(),
        );
        assert_eq!(full.code, code::POOL_EXHAUSTED);
        assert!(full.msg.contains("10.244.9.0/30"), "{}", full.msg);
        assert!(full.msg.contains("hostPrefix"), "{}", full.msg);
        // A container whose namespace is gone: unknown container, and nothing allocated.
        pods.ipam.release("holder", "eth0").unwrap();
        let gone = pods.add(&target("third"), &node).unwrap_err();
        assert_eq!(gone.code, code::UNKNOWN_CONTAINER, "{}", gone.msg);
        assert_eq!(pods.ipam.allocations().count(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
