//! The CNI plugin (`dataplane-cni`) and its counterpart in the agent.
//!
//! The container runtime runs the plugin for every pod (CNI specification 1.1: ADD, DEL,
//! CHECK, STATUS, VERSION, GC; configurations of versions 0.4.0, 1.0.0 and 1.1.0). The plugin
//! holds no state: it reads the environment and the configuration, asks the node's agent over
//! a unix socket, and prints the agent's answer as the specification shapes it. The agent does
//! the work (as OVN-Kubernetes' `ovnkube-node` serves `ovn-k8s-cni-overlay`): it allocates the
//! addresses ([`ipam`]), wires the pod ([`wire`]), and syncs the maps before it
//! answers, so a pod's first packet is already judged by its policy.
//!
//! - [`spec`]: the specification's side (configuration, environment, results, errors).
//! - [`names`]: the container id and interface name checks.
//! - [`ipam`]: the pods' addresses, allocated from the node's pod CIDRs and kept on disk.
//! - [`protocol`]: what the plugin and the agent say to each other.
//! - [`wire`]: the veth pair, addresses, routes and sysctls of one pod.
//! - [`server`]: the agent's socket and the pods it wired.
//! - [`plugin`]: the plugin binary's logic.
//! - [`status`]: the pods' addresses in the cluster state (written back in manifest mode).

pub mod ipam;
pub mod names;
pub mod plugin;
pub mod protocol;
pub mod server;
pub mod spec;
pub mod status;
pub mod wire;

/// Where the agent listens for the plugin unless the configuration says `agentSocket`.
pub const DEFAULT_SOCKET: &str = "/run/dataplane/cni.sock";
/// The socket's file name in the agent's run directory.
pub const SOCKET_FILE: &str = "cni.sock";
/// Where the agent keeps the pods' address allocations (on disk: they outlive reboots).
pub const DEFAULT_IPAM_FILE: &str = "/var/lib/dataplane/ipam.json";
/// The pods' IPv4 gateway: every host-side veth holds it, so the node answers for it.
pub const GATEWAY_V4: std::net::Ipv4Addr = std::net::Ipv4Addr::new(169, 254, 1, 1);
/// The pods' IPv6 gateway, likewise on every host-side veth.
pub const GATEWAY_V6: std::net::Ipv6Addr = std::net::Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
/// The configuration file the agent writes once it serves the plugin: runtimes take the first
/// file of their configuration directory, and one that reads no STATUS takes the file's
/// presence for "the network is ready".
pub const CONFLIST_FILE: &str = "10-dataplane.conflist";

/// The network configuration list of this plugin, asking the agent at `socket`. Runtimes
/// that know configuration 1.1.0 (STATUS, GC) pick it from `cniVersions`; older ones read
/// `cniVersion`.
pub fn conflist(socket: &std::path::Path) -> serde_json::Value {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "cniVersions": ["1.0.0", "1.1.0"],
        "name": "dataplane",
        "plugins": [{"type": "dataplane-cni", "agentSocket": socket}],
    })
}

/// Writes [`conflist`] into `conf_dir` (atomically); returns the file.
pub fn write_conflist(
    conf_dir: &std::path::Path,
    socket: &std::path::Path,
) -> std::io::Result<std::path::PathBuf> {
    let path = conf_dir.join(CONFLIST_FILE);
    let text = serde_json::to_vec_pretty(&conflist(socket)).map_err(std::io::Error::other)?;
    // Readable by all, as the runtime's other configuration files are.
    crate::kernel::state::write_replacing(&path, &text, true, 0o644)?;
    Ok(path)
}

/// Copies the plugin binary `plugin` into `bin_dir` as `dataplane-cni` (written aside and
/// renamed, so a runtime never runs half a binary); returns the installed file.
pub fn install_plugin(
    plugin: &std::path::Path,
    bin_dir: &std::path::Path,
    name: &str,
) -> std::io::Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::create_dir_all(bin_dir)?;
    let target = bin_dir.join(name);
    let aside = bin_dir.join(format!(".{name}.tmp"));
    std::fs::copy(plugin, &aside)?;
    std::fs::set_permissions(&aside, std::fs::Permissions::from_mode(0o755))?;
    std::fs::rename(&aside, &target)?;
    Ok(target)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_conflist_names_the_plugin_and_its_socket() {
        let list = super::conflist(std::path::Path::new("/run/dataplane/cni.sock"));
        assert_eq!(list["plugins"][0]["type"], "dataplane-cni");
        assert_eq!(list["plugins"][0]["agentSocket"], "/run/dataplane/cni.sock");
        assert_eq!(list["cniVersions"], serde_json::json!(["1.0.0", "1.1.0"]));
    }
}
