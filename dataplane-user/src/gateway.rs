//! The node's gateway SNAT: pod traffic leaving the cluster through the underlay takes the
//! node's address, as OVN-Kubernetes' gateway router does. Pods an EgressIP selects never get
//! here (the kernel programs reroute or drop their traffic before the stack sees it); what
//! stays inside the cluster (pods, services, nodes) keeps the pod's address.
//!
//! It is an nftables table the agent owns (`inet dataplane_gateway`), replaced whole in one
//! transaction when the cluster's networks or nodes change. Conntrack then un-NATs the
//! replies. What pods send within the cluster through the node is not tracked by it
//! (`notrack`; the dataplane tracks it). Ports 61000-65535 of the node are left to the load-balancer's own masquerade
//! (`dataplane_common::lb::SNAT_PORT_MIN`), which conntrack does not see; its low range
//! (1024-32767) only ever goes to other nodes' pods, where this table never sends.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::error::AgentError;

/// The table's name (family `inet`).
pub const TABLE: &str = "dataplane_gateway";

/// What the SNAT is compiled from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GatewayInputs {
    /// The underlay NIC: only traffic leaving through it is translated.
    pub underlay: String,
    pub cluster_networks: Vec<IpNet>,
    pub service_networks: Vec<IpNet>,
    pub node_addresses: Vec<IpAddr>,
}

/// The nftables script that makes the table what `inputs` say: created if missing, then
/// deleted and written anew, all in one transaction (`nft -f` applies a file atomically).
pub fn script(inputs: &GatewayInputs) -> String {
    let mut out = format!("table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n");
    let mut rules = Vec::new();
    let mut untracked = Vec::new();
    for (family, v4) in [("ip", true), ("ip6", false)] {
        let of_family = |nets: &mut dyn Iterator<Item = IpNet>| -> Vec<String> {
            nets.filter(|n| n.addr().is_ipv4() == v4)
                .map(|n| n.trunc().to_string())
                .collect()
        };
        let pods = of_family(&mut inputs.cluster_networks.iter().copied());
        if pods.is_empty() {
            continue;
        }
        let internal = of_family(
            &mut inputs
                .cluster_networks
                .iter()
                .chain(&inputs.service_networks)
                .copied()
                .chain(inputs.node_addresses.iter().map(|a| IpNet::from(*a))),
        );
        let kind = if v4 { "ipv4_addr" } else { "ipv6_addr" };
        let suffix = if v4 { "v4" } else { "v6" };
        for (name, elements) in [("pods", &pods), ("internal", &internal)] {
            out.push_str(&format!(
                "  set {name}_{suffix} {{ type {kind}; flags interval; auto-merge; elements = {{ {} }} }}\n",
                elements.join(", ")
            ));
        }
        let matches = format!(
            "oifname \"{}\" {family} saddr @pods_{suffix} {family} daddr != @internal_{suffix}",
            inputs.underlay
        );
        // TCP and UDP below the load-balancer's ports; ICMP (echo ids) and the rest as they come.
        rules.push(format!(
            "{matches} meta l4proto {{ tcp, udp }} masquerade to :1024-{}",
            dataplane_common::lb::SNAT_PORT_MIN - 1
        ));
        rules.push(format!(
            "{matches} meta l4proto != {{ tcp, udp }} masquerade"
        ));
        // What pods send within the cluster through this node (not to this node's own
        // addresses) is the dataplane's to track, and the other direction of such a flow
        // mostly never passes this stack (XDP and tc deliver it): a NodePort backend's replies
        // to the ingress node's masquerade port were picked up as new entries every time, and
        // a port that came round again while its last flow's entry lived on clashed there
        // (conntrack dropped the reply, the backend waited 200 ms to send it again).
        untracked.push(format!(
            "{family} saddr @pods_{suffix} {family} daddr @internal_{suffix} fib daddr type != local notrack"
        ));
    }
    out.push_str(
        "  chain prerouting {\n    type filter hook prerouting priority raw; policy accept;\n",
    );
    for rule in untracked {
        out.push_str(&format!("    {rule}\n"));
    }
    out.push_str("  }\n");
    out.push_str(
        "  chain postrouting {\n    type nat hook postrouting priority srcnat; policy accept;\n",
    );
    for rule in rules {
        out.push_str(&format!("    {rule}\n"));
    }
    out.push_str("  }\n}\n");
    out
}

/// Applies `script` with `nft -f -`.
pub fn apply(script: &str) -> Result<(), AgentError> {
    crate::kernel::netdev::run_nft(TABLE, script)
}

/// Removes the table (nothing when it is not there).
pub fn remove() -> Result<(), AgentError> {
    crate::kernel::netdev::remove_nft_table(TABLE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_leaving_through_the_underlay_for_outside_the_cluster_are_masqueraded() {
        let inputs = GatewayInputs {
            underlay: "eth0".into(),
            cluster_networks: vec!["10.244.0.0/16".parse().unwrap()],
            service_networks: vec!["10.96.0.0/16".parse().unwrap()],
            node_addresses: vec!["10.99.0.1".parse().unwrap(), "fd99::1".parse().unwrap()],
        };
        let script = script(&inputs);
        assert!(
            script
                .starts_with("table inet dataplane_gateway\ndelete table inet dataplane_gateway\n")
        );
        assert!(script.contains(
            "set internal_v4 { type ipv4_addr; flags interval; auto-merge; elements = { 10.244.0.0/16, 10.96.0.0/16, 10.99.0.1/32 } }"
        ));
        assert!(script.contains(
            "oifname \"eth0\" ip saddr @pods_v4 ip daddr != @internal_v4 meta l4proto { tcp, udp } masquerade to :1024-60999"
        ));
        // Pods' traffic within the cluster, forwarded here, is not tracked by the node.
        assert!(script.contains(
            "type filter hook prerouting priority raw; policy accept;\n    ip saddr @pods_v4 ip daddr @internal_v4 fib daddr type != local notrack\n"
        ), "{script}");
        // No IPv6 pod network: no IPv6 rule (the node's IPv6 address alone makes none).
        assert!(!script.contains("ip6 saddr"), "{script}");
    }
}
