//! The CNI plugin run exactly as a container runtime runs it: a clean environment holding the
//! `CNI_*` variables, the network configuration on stdin, one JSON document read back from
//! stdout, the exit status kept.

use std::{
    io::Write as _,
    net::IpAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail, ensure};
use serde_json::{Value, json};

use crate::topology::{Agent, Pod, Topology, dataplane_binary};

/// The plugin binary, built beside the agent.
pub fn plugin_binary() -> PathBuf {
    dataplane_binary().with_file_name("dataplane-cni")
}

/// Starts an agent on each of `topology`'s first `nodes` nodes writing its network
/// configuration into a directory of its own (`--cni-conf-dir`, as the DaemonSet gives the
/// runtime's), and waits until each wrote it; the agents and their directories.
pub fn start_agents_with_conf_dirs(
    topology: &Topology,
    nodes: usize,
) -> anyhow::Result<(Vec<Agent>, Vec<PathBuf>)> {
    let dirs: Vec<PathBuf> = (0..nodes)
        .map(|n| std::env::temp_dir().join(crate::unique_name(&format!("net.d{n}"))))
        .collect();
    let mut agents = Vec::new();
    for (n, dir) in dirs.iter().enumerate() {
        let dir_arg = dir.display().to_string();
        agents.push(
            topology
                .node(n)
                .start_agent_with(&["--cni-conf-dir", &dir_arg])?,
        );
    }
    for dir in &dirs {
        let file = dir.join("10-dataplane.conflist");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !file.exists() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        ensure!(file.exists(), "{} not written", file.display());
    }
    Ok((agents, dirs))
}

/// What the plugin printed and how it exited.
#[derive(Debug)]
pub struct Answer {
    pub success: bool,
    pub output: Option<Value>,
}

impl Answer {
    /// The error code of a failed command (panics on success, to name the test's mistake).
    pub fn code(&self) -> u64 {
        assert!(!self.success, "expected a failure, got {:?}", self.output);
        self.output.as_ref().expect("an error document")["code"]
            .as_u64()
            .expect("a numeric code")
    }

    pub fn message(&self) -> String {
        self.output
            .as_ref()
            .and_then(|o| o["msg"].as_str())
            .unwrap_or_default()
            .to_owned()
    }
}

/// A plugin configuration of `version` pointing at `socket`.
pub fn conf(version: &str, socket: &Path) -> Value {
    json!({
        "cniVersion": version,
        "name": "dataplane",
        "type": "dataplane-cni",
        "agentSocket": socket,
        "agentTimeoutSeconds": 30,
    })
}

/// The socket of `agent`.
pub fn socket(agent: &Agent) -> PathBuf {
    agent.run_dir.join("cni.sock")
}

/// Runs the plugin with exactly `env` and `stdin`.
pub fn invoke(env: &[(&str, &str)], stdin: &str) -> anyhow::Result<Answer> {
    let mut child = Command::new(plugin_binary())
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("running dataplane-cni")?;
    child
        .stdin
        .take()
        .context("plugin stdin")?
        .write_all(stdin.as_bytes())?;
    let out = child.wait_with_output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let output = if text.trim().is_empty() {
        None
    } else {
        Some(serde_json::from_str(&text).with_context(|| format!("plugin printed {text:?}"))?)
    };
    Ok(Answer {
        success: out.status.success(),
        output,
    })
}

/// One container interface as the runtime sees it.
#[derive(Clone, Debug)]
pub struct Container {
    pub id: String,
    /// The namespace's name under /run/netns.
    pub netns: String,
    pub namespace: String,
    pub name: String,
    /// `K8S_POD_UID` (empty: not passed).
    pub uid: String,
}

impl Container {
    pub fn netns_path(&self) -> String {
        format!("/run/netns/{}", self.netns)
    }

    fn args(&self) -> String {
        let mut args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={}",
            self.namespace, self.name
        );
        if !self.uid.is_empty() {
            args.push_str(&format!(";K8S_POD_UID={}", self.uid));
        }
        args
    }

    /// Runs `command` for this container's `eth0`.
    pub fn run(&self, command: &str, conf: &Value) -> anyhow::Result<Answer> {
        let netns = self.netns_path();
        let args = self.args();
        invoke(
            &[
                ("CNI_COMMAND", command),
                ("CNI_CONTAINERID", &self.id),
                ("CNI_NETNS", &netns),
                ("CNI_IFNAME", "eth0"),
                ("CNI_ARGS", &args),
                ("CNI_PATH", "/opt/cni/bin"),
            ],
            &conf.to_string(),
        )
    }
}

/// A new container (its own network namespace) for pod `namespace/name`.
pub fn container(
    topology: &mut Topology,
    namespace: &str,
    name: &str,
) -> anyhow::Result<Container> {
    let netns = topology.add_pod_netns("cni")?;
    Ok(Container {
        id: format!("{netns}-container"),
        netns,
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        uid: String::new(),
    })
}

/// ADD through the plugin; the pod as the test bed's other helpers take it, and the result.
pub fn add(container: &Container, conf: &Value) -> anyhow::Result<(Pod, Value)> {
    let answer = container.run("ADD", conf)?;
    ensure!(
        answer.success,
        "ADD of {}/{} failed: {:?}",
        container.namespace,
        container.name,
        answer.output
    );
    let result = answer.output.context("ADD printed no result")?;
    let pod = pod_of(container, &result)?;
    Ok((pod, result))
}

/// The pod a result describes.
pub fn pod_of(container: &Container, result: &Value) -> anyhow::Result<Pod> {
    let mut ip = None;
    let mut ip6 = None;
    for entry in result["ips"].as_array().context("result without ips")? {
        let address = entry["address"].as_str().context("ip without address")?;
        let (address, _) = address.split_once('/').context("address not in CIDR")?;
        match address.parse::<IpAddr>()? {
            IpAddr::V4(v4) => ip = Some(v4),
            IpAddr::V6(v6) => ip6 = Some(v6),
        }
    }
    let mac_text = result["interfaces"][1]["mac"]
        .as_str()
        .context("result without the pod's MAC")?;
    let mac = dataplane_user::kernel::netdev::parse_mac(mac_text)
        .with_context(|| format!("MAC {mac_text:?}"))?;
    let Some(ip) = ip else {
        bail!("result without an IPv4 address: {result}");
    };
    Ok(Pod {
        netns: container.netns.clone(),
        name: container.name.clone(),
        namespace: container.namespace.clone(),
        ip,
        ip6,
        mac,
        host_iface: result["interfaces"][0]["name"]
            .as_str()
            .context("result without the host veth")?
            .to_owned(),
    })
}

/// The addresses the IPAM file of `agent` holds, by container id.
pub fn allocations(agent: &Agent) -> anyhow::Result<Vec<(String, Vec<String>)>> {
    let text = std::fs::read_to_string(agent.run_dir.join("ipam.json"))?;
    let stored: Value = serde_json::from_str(&text)?;
    let mut out = Vec::new();
    for allocation in stored["allocations"]
        .as_object()
        .context("no allocations")?
        .values()
    {
        let addresses = allocation["addresses"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str().map(str::to_owned))
            .collect();
        out.push((
            allocation["container_id"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            addresses,
        ));
    }
    Ok(out)
}

/// A pod the plugin is to wire as pod `index` of `node`: its container (a new namespace), and
/// the pod ADD will make of it, foreseen: the node's IPAM gives a fresh node's pods the
/// addresses after the gateway in order, IPv4's third kept back (the node's hybrid overlay
/// router), and the names and MAC follow from those.
pub fn planned_pod(
    topology: &mut Topology,
    node: usize,
    index: usize,
    namespace: &str,
) -> anyhow::Result<(Container, Pod)> {
    let name = format!("pod-{node}-{index}");
    let container = container(topology, namespace, &name)?;
    let ip = allocated_ipv4(node, index);
    let o = ip.octets();
    let pod = Pod {
        netns: container.netns.clone(),
        name,
        namespace: namespace.to_owned(),
        ip,
        ip6: Some(crate::topology::pod_ip6(node, index)),
        mac: [0x0a, 0x58, o[0], o[1], o[2], o[3]],
        host_iface: dataplane_user::cni::wire::host_iface_name(&container.id, "eth0"),
    };
    Ok((container, pod))
}

/// The IPv4 address a fresh node's IPAM gives its pod `index`: .2, then .4 on (.3 is the
/// node's hybrid overlay router, never a pod's).
pub fn allocated_ipv4(node: usize, index: usize) -> std::net::Ipv4Addr {
    let offset = if index == 0 { 2 } else { index + 3 };
    std::net::Ipv4Addr::new(10, 244, node as u8 + 1, offset as u8)
}

/// The Pod object of `pod` on node `node` as the API server has it before the pod runs:
/// labelled `pod: <name>`, scheduled, no addresses yet (the plugin gives them).
pub fn pod_manifest(pod: &Pod, node: usize) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {namespace}, labels: {{pod: {name}}}}}\n\
         spec: {{nodeName: {node_name}, containers: [{{name: app, image: registry.k8s.io/pause:3.9}}]}}\n",
        name = pod.name,
        namespace = pod.namespace,
        node_name = crate::topology::node_name(node),
    )
}

/// ADD of a planned pod; fails unless the plugin made exactly the pod foreseen.
pub fn add_planned(container: &Container, planned: &Pod, conf: &Value) -> anyhow::Result<()> {
    let (pod, _) = add(container, conf)?;
    ensure!(
        (pod.ip, pod.ip6, pod.mac, &pod.host_iface)
            == (planned.ip, planned.ip6, planned.mac, &planned.host_iface),
        "ADD of {} gave {pod:?}, not the foreseen {planned:?}",
        planned.name
    );
    Ok(())
}
