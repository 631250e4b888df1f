//! The router pod's second interface: a macvlan on the node's NIC holding the reserved
//! address, the routes to the destinations through the node network's gateway, and the
//! redirect with its source translation in nftables inside the pod.
//!
//! nftables inside the pod, as the reference plugin does (iptables there): the redirect is
//! per connection (conntrack translates the replies back), lives and dies with the pod's
//! network namespace, and touches no map or program of the node, so a router pod can never
//! change another pod's traffic. The pod's default route stays on its primary interface:
//! the cluster, service and hybrid networks, cluster DNS and the kubelet's probes keep
//! working without the plugin knowing those networks, and what leaves through the reserved
//! address is exactly what the redirects send (each destination has its own route through
//! the gateway).

use std::{fs::File, net::IpAddr, path::Path};

use ipnet::IpNet;
use serde_json::{Value, json};

use super::config::RouterConf;
use crate::cni::{
    spec::{CniError, code},
    wire::{self, WireError},
};
use crate::kernel::netdev;

/// The nftables table the plugin writes in the router pod.
pub const TABLE: &str = "egress_router";

/// The container interface to make, as the runtime named it.
pub struct Target<'a> {
    pub container_id: &'a str,
    pub netns: &'a Path,
    pub ifname: &'a str,
}

/// ADD: the macvlan made and moved into the pod, addressed, routed and redirected; the CNI
/// result for `conf.cni_version`. A failure removes what was made.
pub fn add(conf: &RouterConf, target: &Target<'_>) -> Result<Value, CniError> {
    let netns = open(target.netns)?;
    let master = match &conf.master {
        Some(master) => master.clone(),
        None => default_route_device(conf.address.addr()).map_err(failed)?,
    };
    let temporary = temporary_name(target.container_id, target.ifname);
    // A leftover of an earlier attempt under the same name goes first.
    let _ = netdev::run_ip(&["link", "del", &temporary], None);
    let mtu = conf.mtu.map(|m| format!(" mtu {m}")).unwrap_or_default();
    wire::ip_batch(
        "the node",
        &[
            format!(
                "link add link {master} name {temporary}{mtu} type macvlan mode {}",
                conf.mode.name()
            ),
            format!(
                "link set dev {temporary} netns {} name {}",
                wire::fd_path(&netns).display(),
                target.ifname
            ),
        ],
    )
    .map_err(|error| {
        // Made but not moved: it must not stay on the node.
        let _ = netdev::run_ip(&["link", "del", &temporary], None);
        failed(error)
    })?;
    let made = wire::in_netns(&netns, || inside(conf, target.ifname));
    match made {
        Ok(mac) => Ok(result(conf, target, &mac)),
        Err(error) => {
            let _ = wire::in_netns(&netns, || {
                remove_inside(target.ifname);
                Ok(())
            });
            Err(failed(error))
        }
    }
}

/// DEL: the interface and the table gone from the pod (nothing when they, or the pod's
/// namespace, are gone already), and any leftover on the node.
pub fn del(container_id: &str, netns: Option<&Path>, ifname: &str) -> Result<(), CniError> {
    if let Some(netns) = netns
        && let Ok(netns) = wire::open_pod_netns(netns, &default_dirs())
    {
        wire::in_netns(&netns, || {
            remove_inside(ifname);
            Ok(())
        })
        .map_err(failed)?;
    }
    let _ = netdev::run_ip(
        &["link", "del", &temporary_name(container_id, ifname)],
        None,
    );
    Ok(())
}

/// CHECK: the interface holds the reserved address and the redirect table is there.
pub fn check(conf: &RouterConf, target: &Target<'_>) -> Result<(), CniError> {
    let netns = open(target.netns)?;
    let mismatch = |why: String| CniError::new(code::CHECK_FAILED, why);
    wire::in_netns(&netns, || {
        let addresses = netdev::interface_networks(target.ifname);
        let table = table_present(nft_family(conf));
        Ok((addresses, table))
    })
    .map_err(failed)
    .and_then(|(addresses, table)| {
        if !addresses.contains(&conf.address) {
            return Err(mismatch(format!(
                "{} does not hold {} (it has {addresses:?})",
                target.ifname, conf.address
            )));
        }
        if !table {
            return Err(mismatch(format!(
                "the redirect table {TABLE} is missing in the pod"
            )));
        }
        Ok(())
    })
}

/// Inside the pod: forwarding on, the address on the macvlan (announced as it comes up:
/// a gratuitous ARP, or an unsolicited neighbour advertisement), the destinations' routes and
/// the redirect. Returns the macvlan's MAC.
fn inside(conf: &RouterConf, ifname: &str) -> Result<[u8; 6], WireError> {
    let v6 = conf.address.addr().is_ipv6();
    if v6 {
        wire::set_sysctl("net/ipv6/conf/all/forwarding", "1");
        wire::set_sysctl(&format!("net/ipv6/conf/{ifname}/ndisc_notify"), "1");
        wire::set_sysctl(&format!("net/ipv6/conf/{ifname}/accept_dad"), "0");
    } else {
        wire::set_sysctl("net/ipv4/ip_forward", "1");
        wire::set_sysctl(&format!("net/ipv4/conf/{ifname}/arp_notify"), "1");
    }
    let nodad = if v6 { " nodad" } else { "" };
    let mut batch = vec![
        format!("addr add {} dev {ifname}{nodad}", conf.address),
        format!("link set {ifname} up"),
    ];
    for destination in destinations(conf) {
        batch.push(format!(
            "route replace {} via {} dev {ifname}",
            IpNet::from(destination),
            conf.gateway
        ));
    }
    wire::ip_batch("the router pod's namespace", &batch)?;
    netdev::run_nft(TABLE, &nft_script(conf, ifname))
        .map_err(|error| WireError::Mismatch(error.to_string()))?;
    netdev::mac(ifname).map_err(|source| WireError::Netns {
        path: ifname.into(),
        source,
    })
}

/// The distinct destinations outside the reserved address's own network (those inside it
/// are reached directly).
fn destinations(conf: &RouterConf) -> Vec<IpAddr> {
    let mut all: Vec<IpAddr> = conf
        .rules
        .iter()
        .map(|r| r.destination)
        .chain(conf.fallback)
        .filter(|d| !conf.address.trunc().contains(d))
        .collect();
    all.sort();
    all.dedup();
    all
}

fn nft_family(conf: &RouterConf) -> &'static str {
    if conf.address.addr().is_ipv6() {
        "ip6"
    } else {
        "ip"
    }
}

/// The redirect: what arrives other than on the macvlan goes to its rule's destination (or
/// the fallback); what leaves by the macvlan takes the reserved address. A port with no rule
/// and no fallback reaches the pod's own stack, where nothing listens: refused (TCP reset,
/// ICMP port unreachable), never dropped silently.
pub fn nft_script(conf: &RouterConf, ifname: &str) -> String {
    let family = nft_family(conf);
    let at = |address: IpAddr, port: Option<u16>| match (address, port) {
        (IpAddr::V4(a), Some(p)) => format!("{a}:{p}"),
        (IpAddr::V6(a), Some(p)) => format!("[{a}]:{p}"),
        (a, None) => a.to_string(),
    };
    let mut script = format!(
        "table {family} {TABLE}\ndelete table {family} {TABLE}\n\
         table {family} {TABLE} {{\n\
         \x20 chain prerouting {{\n\
         \x20   type nat hook prerouting priority dstnat; policy accept;\n\
         \x20   iifname \"{ifname}\" return\n"
    );
    for rule in &conf.rules {
        script.push_str(&format!(
            "    {} dport {} dnat to {}\n",
            rule.protocol.name(),
            rule.port,
            at(rule.destination, Some(rule.target_port))
        ));
    }
    if let Some(fallback) = conf.fallback {
        script.push_str(&format!("    dnat to {}\n", at(fallback, None)));
    }
    script.push_str(&format!(
        "  }}\n  chain postrouting {{\n\
         \x20   type nat hook postrouting priority srcnat; policy accept;\n\
         \x20   oifname \"{ifname}\" snat to {}\n  }}\n}}\n",
        conf.address.addr()
    ));
    script
}

/// The ADD result: the pod's macvlan, its reserved address with the gateway, the destinations'
/// routes.
fn result(conf: &RouterConf, target: &Target<'_>, mac: &[u8; 6]) -> Value {
    let v4 = conf.address.addr().is_ipv4();
    let mut ip = json!({
        "address": conf.address.to_string(),
        "gateway": conf.gateway.to_string(),
        "interface": 0,
    });
    if conf.cni_version == "0.4.0" {
        ip["version"] = json!(if v4 { "4" } else { "6" });
    }
    let routes: Vec<Value> = destinations(conf)
        .into_iter()
        .map(|d| json!({"dst": IpNet::from(d).to_string(), "gw": conf.gateway.to_string()}))
        .collect();
    json!({
        "cniVersion": conf.cni_version,
        "interfaces": [{
            "name": target.ifname,
            "mac": netdev::mac_text(mac),
            "sandbox": target.netns.display().to_string(),
        }],
        "ips": [ip],
        "routes": routes,
        "dns": {},
    })
}

/// Removes the macvlan and the table from the current thread's namespace (what is not there
/// is left alone).
fn remove_inside(ifname: &str) {
    let _ = netdev::run_ip(&["link", "del", ifname], None);
    for family in ["ip", "ip6"] {
        let _ = netdev::run_nft(
            TABLE,
            &format!("table {family} {TABLE}\ndelete table {family} {TABLE}\n"),
        );
    }
}

/// Whether the redirect table of `family` is in the current thread's namespace.
fn table_present(family: &str) -> bool {
    let mut command = std::process::Command::new("nft");
    command.args(["list", "table", family, TABLE]);
    netdev::run_bounded(&mut command, None, netdev::CHILD_TIMEOUT)
        .is_ok_and(|(status, _, _)| status.success())
}

/// The interface of the node's default route of `address`'s family.
fn default_route_device(address: IpAddr) -> Result<String, WireError> {
    let family = if address.is_ipv6() { "-6" } else { "-4" };
    let routes = wire::ip_json("the node", &["-j", family, "route", "show", "default"])?;
    routes
        .as_array()
        .and_then(|r| r.first())
        .and_then(|r| r.get("dev"))
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| {
            WireError::Mismatch(
                "the node has no default route to take the macvlan's master from; set interfaceArgs.master"
                    .to_owned(),
            )
        })
}

/// The macvlan's name on the node before it moves into the pod: `er` and 13 hex digits of
/// a hash of (container id, interface name), unique per attachment.
fn temporary_name(container_id: &str, ifname: &str) -> String {
    format!("er{}", &wire::host_iface_name(container_id, ifname)[2..])
}

fn open(netns: &Path) -> Result<File, CniError> {
    wire::open_pod_netns(netns, &default_dirs()).map_err(failed)
}

fn default_dirs() -> Vec<std::path::PathBuf> {
    wire::DEFAULT_NETNS_DIRS.iter().map(Into::into).collect()
}

fn failed(error: WireError) -> CniError {
    CniError::new(code::WIRING_FAILED, error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_redirect_is_one_nat_table_per_family() {
        let conf = super::super::config::parse(
            br#"{"cniVersion": "1.0.0", "ip": {"addresses": ["192.168.12.99/24"], "destinations": ["80 tcp 203.0.113.25", "8080 tcp 203.0.113.26 80", "53 udp 192.168.12.53", "203.0.113.27"], "gateway": "192.168.12.1"}}"#,
        )
        .expect("valid");
        assert_eq!(
            nft_script(&conf, "net1"),
            "table ip egress_router\ndelete table ip egress_router\n\
             table ip egress_router {\n\
             \x20 chain prerouting {\n\
             \x20   type nat hook prerouting priority dstnat; policy accept;\n\
             \x20   iifname \"net1\" return\n\
             \x20   tcp dport 80 dnat to 203.0.113.25:80\n\
             \x20   tcp dport 8080 dnat to 203.0.113.26:80\n\
             \x20   udp dport 53 dnat to 192.168.12.53:53\n\
             \x20   dnat to 203.0.113.27\n\
             \x20 }\n\
             \x20 chain postrouting {\n\
             \x20   type nat hook postrouting priority srcnat; policy accept;\n\
             \x20   oifname \"net1\" snat to 192.168.12.99\n\
             \x20 }\n}\n"
        );
        // Routed through the gateway: the destinations off the node network, once each.
        let routed: Vec<String> = destinations(&conf)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(routed, ["203.0.113.25", "203.0.113.26", "203.0.113.27"]);
        let v6 = super::super::config::parse(
            br#"{"cniVersion": "1.0.0", "ip": {"addresses": ["fd00:12::99/64"], "destinations": ["443 tcp fd00:99::1 8443"], "gateway": "fd00:12::1"}}"#,
        )
        .expect("valid");
        let script = nft_script(&v6, "net1");
        assert!(script.contains("table ip6 egress_router {"));
        assert!(script.contains("tcp dport 443 dnat to [fd00:99::1]:8443"));
        assert!(script.contains("oifname \"net1\" snat to fd00:12::99"));
    }

    #[test]
    fn temporary_names_fit_an_interface_name_and_differ_from_the_pods_veths() {
        let name = temporary_name("0123456789abcdef", "net1");
        assert_eq!(name.len(), 15);
        assert!(name.starts_with("er"));
        assert_ne!(name, wire::host_iface_name("0123456789abcdef", "net1"));
    }
}
