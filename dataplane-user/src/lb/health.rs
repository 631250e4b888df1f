//! The health-check node ports of `externalTrafficPolicy: Local` LoadBalancer Services, served
//! as kube-proxy serves them: a cloud load balancer asks every node and sends the Service's
//! traffic only to those that answer 200, the nodes with a ready endpoint of it. Every port
//! is a listener of its own on one small runtime (one thread) beside the agent's loop; a sync
//! opens the ports that appear and closes those that go, and a port that cannot be bound is
//! that Service's failure alone (logged with its name), retried at the next sync.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener},
    sync::{Arc, RwLock},
};

use http_body_util::Full;
use hyper::{Response, StatusCode, body::Bytes};

use k8s_openapi::{api::core::v1::Node, jiff::Timestamp};

use super::compile::HealthCheck;

/// What a health-check port answers: 200 with the count of local endpoints when there is one,
/// 503 otherwise (and for a port no Service holds any more), with kube-proxy's JSON body and
/// headers.
pub fn health_answer(check: Option<&HealthCheck>) -> Response<Full<Bytes>> {
    let (status, body, weight) = match check {
        Some(check) => {
            let body = serde_json::json!({
                "service": {"namespace": check.namespace, "name": check.name},
                "localEndpoints": check.local_endpoints,
                "serviceProxyHealthy": true,
            });
            let status = if check.local_endpoints > 0 {
                StatusCode::OK
            } else {
                StatusCode::SERVICE_UNAVAILABLE
            };
            (status, body, check.local_endpoints)
        }
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"localEndpoints": 0, "serviceProxyHealthy": true}),
            0,
        ),
    };
    let mut response = crate::http::reply(status, "application/json", body.to_string());
    let headers = response.headers_mut();
    headers.insert("X-Content-Type-Options", "nosniff".parse().expect("header"));
    if let Ok(value) = weight.to_string().parse() {
        headers.insert("X-Load-Balancing-Endpoint-Weight", value);
    }
    response
}

/// kube-proxy's node health (`/healthz`, `/livez`, on 10256 by default): when the service
/// maps were last brought to the cluster, and whether this node should take load-balancer
/// traffic (not while it is being deleted or drained by the cluster autoscaler).
#[derive(Debug)]
pub struct ProxyHealth {
    last_updated: std::sync::Mutex<Option<Timestamp>>,
    node_eligible: std::sync::atomic::AtomicBool,
}

impl Default for ProxyHealth {
    fn default() -> Self {
        Self {
            last_updated: std::sync::Mutex::new(None),
            node_eligible: std::sync::atomic::AtomicBool::new(true),
        }
    }
}

/// The taint the cluster autoscaler puts on a node it is about to remove.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// Whether node `name` should take load-balancer traffic: not when it is being deleted or
/// carries [`TO_BE_DELETED_TAINT`] (as kube-proxy judges it); yes when it is not found.
pub fn node_eligible<'a>(nodes: impl IntoIterator<Item = &'a Arc<Node>>, name: &str) -> bool {
    let Some(node) = nodes
        .into_iter()
        .find(|node| node.metadata.name.as_deref() == Some(name))
    else {
        return true;
    };
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|taints| taints.iter().any(|t| t.key == TO_BE_DELETED_TAINT));
    node.metadata.deletion_timestamp.is_none() && !tainted
}

impl ProxyHealth {
    /// The service maps were just brought to the cluster.
    pub fn updated(&self) {
        *self.last_updated.lock().unwrap_or_else(|p| p.into_inner()) = Some(Timestamp::now());
    }

    pub fn set_node_eligible(&self, eligible: bool) {
        self.node_eligible
            .store(eligible, std::sync::atomic::Ordering::Relaxed);
    }

    /// The answer to `GET path`, given whether the agent's loop is alive: `/healthz` is 200
    /// when the maps have been synced, the loop turns and the node is eligible; `/livez` the
    /// same without eligibility; kube-proxy's JSON bodies.
    pub fn answer(&self, path: &str, alive: Result<(), String>) -> Response<Full<Bytes>> {
        let last = *self.last_updated.lock().unwrap_or_else(|p| p.into_inner());
        let healthy = alive.is_ok() && last.is_some();
        let eligible = self
            .node_eligible
            .load(std::sync::atomic::Ordering::Relaxed);
        let times = serde_json::json!({
            "lastUpdated": last.map(|t| t.to_string()).unwrap_or_default(),
            "currentTime": Timestamp::now().to_string(),
        });
        let (ok, body) = match path {
            "/healthz" => {
                let mut body = times;
                body["nodeEligible"] = eligible.into();
                (healthy && eligible, body)
            }
            "/livez" => (healthy, times),
            _ => {
                return crate::http::reply(
                    StatusCode::NOT_FOUND,
                    "text/plain",
                    "only /healthz and /livez\n".into(),
                );
            }
        };
        let status = if ok {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        let mut response = crate::http::reply(status, "application/json", body.to_string());
        response
            .headers_mut()
            .insert("X-Content-Type-Options", "nosniff".parse().expect("header"));
        response
    }
}

/// Serves kube-proxy's node health on `address` (load balancers probe it), alive while `alive`
/// says so (the agent's loop turns). A port that cannot be taken costs the probes only: the
/// dataplane runs on, and says so.
pub fn serve_proxy_health(
    address: SocketAddr,
    health: &Arc<ProxyHealth>,
    alive: Arc<dyn Fn() -> Result<(), String> + Send + Sync>,
) {
    let listener = match crate::http::bind(address) {
        Ok(listener) => listener,
        Err(error) => {
            tracing::error!(%error, "node health (kube-proxy's /healthz) not served");
            return;
        }
    };
    let health = Arc::clone(health);
    let handler: Arc<crate::http::Handler> =
        Arc::new(move |request, _peer| health.answer(request.uri().path(), alive()));
    match crate::http::spawn("node-health", listener, handler) {
        Ok(()) => tracing::info!(%address, "serving node health on /healthz and /livez"),
        Err(error) => tracing::error!(%error, "node health (kube-proxy's /healthz) not served"),
    }
}

/// The health-check listeners, by port.
pub struct HealthServers {
    /// Taken by `Drop` only.
    runtime: Option<tokio::runtime::Runtime>,
    /// What each port answers now: the servers read it at each request.
    checks: Arc<RwLock<BTreeMap<u16, HealthCheck>>>,
    listening: BTreeMap<u16, tokio::task::JoinHandle<()>>,
}

impl HealthServers {
    /// No listener yet; the runtime's one thread is named `service-health`.
    pub fn new() -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("service-health")
            .enable_all()
            .build()?;
        Ok(Self {
            runtime: Some(runtime),
            checks: Arc::default(),
            listening: BTreeMap::new(),
        })
    }

    /// Serves exactly `checks`: new ports opened, gone ones closed, every port's answer the
    /// new one. Returns a line for each port that could not be opened (naming its Service).
    pub fn sync(&mut self, checks: BTreeMap<u16, HealthCheck>) -> Vec<String> {
        let gone: Vec<u16> = self
            .listening
            .keys()
            .filter(|port| !checks.contains_key(port))
            .copied()
            .collect();
        for port in gone {
            if let Some(server) = self.listening.remove(&port) {
                server.abort();
            }
        }
        let mut failed = Vec::new();
        for (port, check) in &checks {
            if self.listening.contains_key(port) {
                continue;
            }
            match listen(*port) {
                Ok(listener) => {
                    let server = self.server(listener, *port);
                    self.listening.insert(*port, server);
                }
                Err(error) => failed.push(format!(
                    "Service {}/{}: spec.healthCheckNodePort: {port}: cannot listen: {error}",
                    check.namespace, check.name
                )),
            }
        }
        *self.checks.write().unwrap_or_else(|p| p.into_inner()) = checks;
        failed
    }

    /// The ports served now.
    pub fn ports(&self) -> Vec<u16> {
        self.listening.keys().copied().collect()
    }

    fn server(&self, listener: TcpListener, port: u16) -> tokio::task::JoinHandle<()> {
        let checks = Arc::clone(&self.checks);
        let handler: Arc<crate::http::Handler> = Arc::new(move |_request, _peer| {
            let checks = checks.read().unwrap_or_else(|p| p.into_inner());
            health_answer(checks.get(&port))
        });
        let runtime = self.runtime.as_ref().expect("taken only by drop");
        runtime.spawn(crate::http::serve(
            listener,
            handler,
            format!("health-check {port}"),
        ))
    }
}

impl Drop for HealthServers {
    fn drop(&mut self) {
        // The agent's own runtime may be the caller: a runtime may not be dropped (and wait
        // for its threads) there, and the listeners need no goodbye.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// A listener on every address of the node at `port`: IPv6 and IPv4 on one socket where the
/// node has IPv6, IPv4 alone otherwise. Non-blocking, for the runtime.
fn listen(port: u16) -> std::io::Result<TcpListener> {
    let listener = TcpListener::bind(SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)))
        .or_else(|_| TcpListener::bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port))))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn check(local_endpoints: usize) -> HealthCheck {
        HealthCheck {
            port: 32000,
            namespace: "shop".into(),
            name: "front".into(),
            local_endpoints,
        }
    }

    fn body_of(response: Response<Full<Bytes>>) -> (StatusCode, String, serde_json::Value) {
        let status = response.status();
        let weight = response.headers()["X-Load-Balancing-Endpoint-Weight"]
            .to_str()
            .expect("header")
            .to_owned();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let bytes = runtime
            .block_on(response.into_body().collect())
            .expect("body")
            .to_bytes();
        (
            status,
            weight,
            serde_json::from_slice(&bytes).expect("JSON"),
        )
    }

    /// The servers open and close their ports, and may be dropped inside the agent's own
    /// runtime (where dropping a runtime the usual way panics).
    #[test]
    fn ports_open_and_close_and_the_servers_drop_inside_a_runtime() {
        let mut servers = HealthServers::new().expect("runtime");
        // A free port of this namespace, for a moment.
        let port = TcpListener::bind("127.0.0.1:0")
            .expect("probe")
            .local_addr()
            .expect("address")
            .port();
        let checks = |port| BTreeMap::from([(port, HealthCheck { port, ..check(1) })]);
        assert!(servers.sync(checks(port)).is_empty());
        assert_eq!(servers.ports(), vec![port]);
        // A port that cannot be taken is that Service's failure, named.
        let taken = TcpListener::bind("[::]:0")
            .or_else(|_| TcpListener::bind("0.0.0.0:0"))
            .expect("taken port");
        let taken_port = taken.local_addr().expect("address").port();
        let failed = servers.sync(checks(taken_port));
        assert_eq!(failed.len(), 1, "{failed:?}");
        assert!(failed[0].starts_with(&format!(
            "Service shop/front: spec.healthCheckNodePort: {taken_port}: cannot listen"
        )));
        assert!(servers.ports().is_empty(), "the old port is closed");
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(async move { drop(servers) });
    }

    #[test]
    fn node_health_is_200_once_synced_while_alive_and_eligible() {
        let health = ProxyHealth::default();
        let status = |path: &str, alive: Result<(), String>| health.answer(path, alive).status();
        assert_eq!(status("/healthz", Ok(())), StatusCode::SERVICE_UNAVAILABLE);
        health.updated();
        assert_eq!(status("/healthz", Ok(())), StatusCode::OK);
        assert_eq!(status("/livez", Ok(())), StatusCode::OK);
        assert_eq!(
            status("/healthz", Err("stuck".into())),
            StatusCode::SERVICE_UNAVAILABLE
        );
        health.set_node_eligible(false);
        assert_eq!(status("/healthz", Ok(())), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(status("/livez", Ok(())), StatusCode::OK);
        assert_eq!(status("/metrics", Ok(())), StatusCode::NOT_FOUND);
        let bytes = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(health.answer("/healthz", Ok(())).into_body().collect())
            .expect("body")
            .to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&bytes).expect("JSON");
        assert_eq!(body["nodeEligible"], false);
        assert!(
            body["lastUpdated"]
                .as_str()
                .is_some_and(|t| t.ends_with('Z')),
            "{body}"
        );
        assert!(body["currentTime"].as_str().is_some_and(|t| !t.is_empty()));
    }

    #[test]
    fn a_node_with_local_endpoints_answers_200_and_one_without_503_as_kube_proxy() {
        let (status, weight, body) = body_of(health_answer(Some(&check(2))));
        assert_eq!((status, weight.as_str()), (StatusCode::OK, "2"));
        assert_eq!(
            body,
            serde_json::json!({
                "service": {"namespace": "shop", "name": "front"},
                "localEndpoints": 2,
                "serviceProxyHealthy": true,
            })
        );
        let (status, weight, body) = body_of(health_answer(Some(&check(0))));
        assert_eq!(
            (status, weight.as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, "0")
        );
        assert_eq!(body["localEndpoints"], 0);
        let (status, _, _) = body_of(health_answer(None));
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    }
}
