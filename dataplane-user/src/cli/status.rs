//! `dataplane status`: what is attached where and in which mode, how full each map is, and the
//! packet and drop counters, read from the run directory and the pinned maps.

use std::{fmt::Write as _, os::fd::AsRawFd as _, path::Path};

use aya::maps::MapInfo;
use dataplane_common::maps::{self, ALL_MAPS};
use serde::Serialize;

use crate::{
    error::AgentError,
    kernel::attach::LinkPin,
    kernel::fill::{MapFill, map_fill},
    kernel::pins::Pins,
    kernel::preflight,
    kernel::state::{self, AgentState},
    kernel::stats::{self, Counters},
};

#[derive(Debug, Serialize)]
pub struct StatusReport {
    pub pin_root: String,
    /// `running`, `stopped` (state left by an agent that is gone) or `absent`.
    pub agent: &'static str,
    pub state: Option<AgentState>,
    /// Where the links' interface names come from: `agent namespace` (the running agent's
    /// network namespace, entered to ask), `agent record` (the names a stopped agent wrote
    /// down) or `this namespace` (no agent state: the caller's own).
    pub interfaces_seen_from: &'static str,
    /// The pinned attachments: in force whether or not an agent runs.
    pub links: Vec<PinnedAttachment>,
    pub maps: Vec<MapFill>,
    pub programs: Vec<ProgramCost>,
    pub counters: Option<Counters>,
    /// The pods the CNI plugin had the agent wire, from its allocations.
    pub cni_pods: Vec<CniPod>,
}

/// A pod the CNI plugin had the agent wire.
#[derive(Debug, Serialize)]
pub struct CniPod {
    /// `namespace/name`, or empty when the runtime named none.
    pub pod: String,
    pub container_id: String,
    pub ifname: String,
    pub host_iface: String,
    pub addresses: Vec<String>,
}

/// One of the loaded programs: how much of the verifier's budget it took, and what it costs
/// per run when the kernel's BPF statistics are on (`sysctl kernel.bpf_stats_enabled=1`).
#[derive(Debug, Serialize)]
pub struct ProgramCost {
    pub name: &'static str,
    pub id: u32,
    /// Instructions the verifier walked (its limit is 1,000,000).
    pub verified_instructions: Option<u32>,
    pub runs: u64,
    pub run_time_ns: u64,
}

#[derive(Debug, Serialize)]
pub struct PinnedAttachment {
    #[serde(flatten)]
    pub pin: LinkPin,
    /// The interface's current name; none when it is gone (the link is then defunct).
    pub interface: Option<String>,
}

pub fn collect(pins: &Pins, run_dir: &Path) -> Result<StatusReport, AgentError> {
    let state = state::read(run_dir)?;
    let agent = match &state {
        Some(s) if state::process_alive(s.pid) => "running",
        Some(_) => "stopped",
        None => "absent",
    };
    let mut maps = Vec::new();
    for &name in ALL_MAPS {
        if let Some(fill) = map_fill(pins, name)? {
            maps.push(fill);
        }
    }
    let pinned: Vec<LinkPin> = pins
        .link_names()
        .iter()
        .filter_map(|name| LinkPin::parse(name))
        .collect();
    let ifindexes: Vec<u32> = pinned.iter().map(|pin| pin.ifindex).collect();
    let (names, interfaces_seen_from) = interface_names(state.as_ref(), &ifindexes);
    let links = pinned
        .into_iter()
        .zip(names)
        .map(|(pin, interface)| PinnedAttachment { interface, pin })
        .collect();
    let programs = program_costs(pins);
    let counters = if maps.is_empty() {
        None
    } else {
        Some(stats::read(pins)?)
    };
    let cni_pods = state
        .as_ref()
        .and_then(|s| s.cni.as_ref())
        .map(|cni| cni_pods(&cni.ipam_file))
        .unwrap_or_default();
    Ok(StatusReport {
        cni_pods,
        pin_root: pins.root().display().to_string(),
        agent,
        state,
        interfaces_seen_from,
        links,
        maps,
        programs,
        counters,
    })
}

/// The allocations in `ipam_file`, as pods.
fn cni_pods(ipam_file: &Path) -> Vec<CniPod> {
    let ipam = match crate::cni::ipam::Ipam::open(ipam_file) {
        Ok(ipam) => ipam,
        Err(error) => {
            tracing::warn!(%error, "reading the CNI allocations");
            return Vec::new();
        }
    };
    ipam.allocations()
        .map(|a| CniPod {
            pod: a
                .pod
                .as_ref()
                .map(|p| format!("{}/{}", p.namespace, p.name))
                .unwrap_or_default(),
            container_id: a.container_id.clone(),
            ifname: a.ifname.clone(),
            host_iface: crate::cni::wire::host_iface_name(&a.container_id, &a.ifname),
            addresses: a.addresses.iter().map(|n| n.addr().to_string()).collect(),
        })
        .collect()
}

/// The interface names of `ifindexes` as the node sees them. An ifindex means something only
/// in its own network namespace, and a node's agent often runs in another one than the caller
/// (a node in a namespace, `status` run from the host): the names are asked in the running
/// agent's namespace, from a helper thread so that the caller's own stays as it was.
fn interface_names(
    state: Option<&AgentState>,
    ifindexes: &[u32],
) -> (Vec<Option<String>>, &'static str) {
    let ask_here = |ifindexes: &[u32]| -> Vec<Option<String>> {
        ifindexes
            .iter()
            .map(|&i| preflight::interface_name(i))
            .collect()
    };
    let Some(state) = state else {
        return (ask_here(ifindexes), "this namespace");
    };
    if state::process_alive(state.pid) {
        let netns = format!("/proc/{}/ns/net", state.pid);
        let wanted = ifindexes.to_vec();
        let asked = std::thread::spawn(move || -> std::io::Result<Vec<Option<String>>> {
            let namespace = std::fs::File::open(&netns)?;
            // SAFETY: a valid namespace descriptor; setns changes only this helper thread.
            if unsafe { libc::setns(namespace.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(ask_here(&wanted))
        })
        .join();
        match asked {
            Ok(Ok(names)) => return (names, "agent namespace"),
            Ok(Err(error)) => {
                tracing::debug!(%error, pid = state.pid, "entering the agent's network namespace")
            }
            Err(_) => tracing::debug!("the namespace helper thread panicked"),
        }
    }
    let recorded = ifindexes
        .iter()
        .map(|&ifindex| {
            state
                .attachments
                .iter()
                .find(|a| a.ifindex == ifindex)
                .map(|a| a.interface.clone())
        })
        .collect();
    (recorded, "agent record")
}

/// The programs that use this pin root's counters (the packet programs' or the socket
/// programs'; so not those of another dataplane loaded on the machine, such as a test's), by
/// the names the kernel keeps (15 characters).
fn program_costs(pins: &Pins) -> Vec<ProgramCost> {
    let counters: Vec<u32> = [maps::PACKETS, maps::SOCK_LB_STATS]
        .iter()
        .filter_map(|name| MapInfo::from_pin(pins.map(name)).ok())
        .map(|info| info.id())
        .collect();
    if counters.is_empty() {
        return Vec::new();
    }
    let mut programs: Vec<ProgramCost> = aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .filter(|info| {
            info.map_ids()
                .ok()
                .flatten()
                .is_some_and(|ids| ids.iter().any(|id| counters.contains(id)))
        })
        .filter_map(|info| {
            let kernel_name = info.name_as_str()?.to_owned();
            let name = maps::ALL_PROGRAMS
                .iter()
                .find(|full| kernel_keeps(full) == kernel_name)?;
            Some(ProgramCost {
                name,
                id: info.id(),
                verified_instructions: info.verified_instruction_count(),
                runs: info.run_count(),
                run_time_ns: info.run_time().as_nanos() as u64,
            })
        })
        .collect();
    programs.sort_by_key(|p| (p.name, p.id));
    programs
}

/// The part of a program's name the kernel keeps (`BPF_OBJ_NAME_LEN`, 16 with the NUL).
fn kernel_keeps(name: &str) -> &str {
    name.get(..15).unwrap_or(name)
}

/// The report as aligned text tables.
pub fn render(report: &StatusReport) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "pin root: {}", report.pin_root);
    match &report.state {
        Some(s) => {
            let _ = writeln!(
                out,
                "agent:    {} (pid {}, layout v{})",
                report.agent, s.pid, s.layout_version
            );
            let _ = writeln!(out, "\nattachments:");
            let _ = writeln!(
                out,
                "  {:<16} {:<12} {:<14} MODE",
                "INTERFACE", "HOOK", "PROGRAM"
            );
            for a in &s.attachments {
                let why = a
                    .why
                    .as_ref()
                    .map(|w| format!(" ({w})"))
                    .unwrap_or_default();
                let _ = writeln!(
                    out,
                    "  {:<16} {:<12} {:<14} {}{why}",
                    a.interface, a.hook, a.program, a.mode
                );
            }
        }
        None => {
            let _ = writeln!(out, "agent:    {}", report.agent);
        }
    }
    if !report.links.is_empty() {
        let _ = writeln!(
            out,
            "\npinned links (stay attached while no agent runs; interfaces as seen from the {}):",
            report.interfaces_seen_from
        );
        let _ = writeln!(
            out,
            "  {:<16} {:<8} {:<14} MODE",
            "INTERFACE", "IFINDEX", "PROGRAM"
        );
        for link in &report.links {
            let _ = writeln!(
                out,
                "  {:<16} {:<8} {:<14} {}",
                link.interface.as_deref().unwrap_or("(gone)"),
                link.pin.ifindex,
                link.pin.program,
                link.pin.mode.as_deref().unwrap_or("tcx")
            );
        }
    }
    if let Some(cni) = report.state.as_ref().and_then(|s| s.cni.as_ref()) {
        let _ = writeln!(
            out,
            "\npods wired by the CNI plugin (socket {}, allocations {}):",
            cni.socket.display(),
            cni.ipam_file.display()
        );
        if report.cni_pods.is_empty() {
            let _ = writeln!(out, "  none");
        } else {
            let _ = writeln!(
                out,
                "  {:<30} {:<16} {:<14} ADDRESSES",
                "POD", "HOST VETH", "CONTAINER"
            );
        }
        for pod in &report.cni_pods {
            let short: String = pod.container_id.chars().take(12).collect();
            let _ = writeln!(
                out,
                "  {:<30} {:<16} {:<14} {}",
                if pod.pod.is_empty() { "-" } else { &pod.pod },
                pod.host_iface,
                short,
                pod.addresses.join(", ")
            );
        }
    }
    let _ = writeln!(out, "\nmaps:");
    let _ = writeln!(
        out,
        "  {:<18} {:<14} {:>6} {:>8}",
        "NAME", "TYPE", "USED", "MAX"
    );
    for m in &report.maps {
        let _ = writeln!(
            out,
            "  {:<18} {:<14} {:>6} {:>8}",
            m.name, m.map_type, m.used, m.max_entries
        );
    }
    if !report.programs.is_empty() {
        let _ = writeln!(
            out,
            "\nprograms (run time with `sysctl kernel.bpf_stats_enabled=1`; a tail-called program's \
             time is also its caller's):"
        );
        let _ = writeln!(
            out,
            "  {:<20} {:>6} {:>14} {:>12} {:>10}",
            "NAME", "ID", "VERIFIED INSNS", "RUNS", "NS/RUN"
        );
        for p in &report.programs {
            let per_run = p
                .run_time_ns
                .checked_div(p.runs)
                .map_or_else(|| "-".to_owned(), |ns| ns.to_string());
            let verified = p
                .verified_instructions
                .map_or_else(|| "-".to_owned(), |n| n.to_string());
            let _ = writeln!(
                out,
                "  {:<20} {:>6} {:>14} {:>12} {:>10}",
                p.name, p.id, verified, p.runs, per_run
            );
        }
    }
    if let Some(counters) = &report.counters {
        let _ = writeln!(out, "\npackets:");
        let _ = writeln!(out, "  {:<12} {:<26} {:>12}", "HOOK", "CLASS", "COUNT");
        for p in &counters.packets {
            let _ = writeln!(out, "  {:<12} {:<26} {:>12}", p.hook, p.class, p.count);
        }
        let _ = writeln!(out, "\ndrops:");
        if counters.drops.is_empty() {
            let _ = writeln!(out, "  none");
        }
        for d in &counters.drops {
            let _ = writeln!(out, "  {:<26} {:>10}  {}", d.reason, d.count, d.description);
        }
        if !counters.socket.is_empty() {
            let _ = writeln!(out, "\nsocket-level service translation:");
            for c in &counters.socket {
                let _ = writeln!(out, "  {:<26} {:>10}", c.event, c.count);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        kernel::attach::Attachment,
        kernel::stats::{DropCount, SocketCount},
    };

    #[test]
    fn render_shows_attachments_maps_and_drops() {
        let report = StatusReport {
            pin_root: "/sys/fs/bpf/dataplane".into(),
            agent: "running",
            state: Some(AgentState {
                pid: 9,
                pin_root: "/sys/fs/bpf/dataplane".into(),
                layout_version: 1,
                started_unix: 0,
                cni: Some(crate::kernel::state::CniPlaces {
                    socket: "/run/dataplane/cni.sock".into(),
                    ipam_file: "/var/lib/dataplane/ipam.json".into(),
                }),
                attachments: vec![Attachment {
                    interface: "eth0".into(),
                    ifindex: 2,
                    program: "xdp_underlay".into(),
                    hook: "underlay".into(),
                    mode: "generic".into(),
                    why: Some("native refused: the driver has no XDP".into()),
                }],
            }),
            interfaces_seen_from: "agent namespace",
            links: vec![PinnedAttachment {
                pin: LinkPin {
                    program: "tc_from_pod".into(),
                    ifindex: 4,
                    mode: None,
                },
                interface: None,
            }],
            maps: vec![MapFill {
                name: "DP_DROPS",
                map_type: "PerCpuArray".into(),
                max_entries: 32,
                used: 1,
            }],
            programs: vec![
                ProgramCost {
                    name: "tc_from_pod",
                    id: 41,
                    verified_instructions: Some(812_345),
                    runs: 1000,
                    run_time_ns: 640_000,
                },
                ProgramCost {
                    name: "tc_to_pod",
                    id: 42,
                    verified_instructions: None,
                    runs: 0,
                    run_time_ns: 0,
                },
            ],
            counters: Some(Counters {
                packets: vec![],
                drops: vec![DropCount {
                    reason: "ipv4_bad_ihl",
                    code: 6,
                    description: "IPv4 IHL below 5 words",
                    count: 3,
                }],
                socket: vec![SocketCount {
                    event: "connect",
                    count: 12,
                }],
            }),
            cni_pods: vec![CniPod {
                pod: "web/server".into(),
                container_id: "0123456789abcdef".into(),
                ifname: "eth0".into(),
                host_iface: "dp0123456789abc".into(),
                addresses: vec!["10.244.1.2".into(), "fd00:10:244:1::2".into()],
            }],
        };
        let text = render(&report);
        assert!(
            text.contains("pods wired by the CNI plugin (socket /run/dataplane/cni.sock"),
            "{text}"
        );
        assert!(
            text.contains("web/server")
                && text.contains("0123456789ab ")
                && text.contains("10.244.1.2, fd00:10:244:1::2"),
            "{text}"
        );
        assert!(
            text.contains("agent:    running (pid 9, layout v1)"),
            "{text}"
        );
        // The mode each device got, and why (the modes refused before it).
        assert!(
            text.contains("xdp_underlay   generic (native refused: the driver has no XDP)"),
            "{text}"
        );
        assert!(text.contains("DP_DROPS") && text.contains("32"));
        assert!(
            text.contains("(gone)           4        tc_from_pod    tcx"),
            "{text}"
        );
        assert!(
            text.contains("ipv4_bad_ihl") && text.contains(" 3 "),
            "{text}"
        );
        assert!(
            text.contains(
                "socket-level service translation:\n  connect                            12"
            ),
            "{text}"
        );
        assert!(
            text.contains("tc_from_pod              41         812345         1000        640"),
            "{text}"
        );
        assert!(
            text.contains("tc_to_pod                42              -            0          -"),
            "{text}"
        );
    }

    #[test]
    fn program_names_are_matched_as_the_kernel_truncates_them() {
        assert_eq!(kernel_keeps("tc_from_pod_deliver"), "tc_from_pod_del");
        assert_eq!(kernel_keeps("tc_underlay"), "tc_underlay");
        let matches = |kernel: &str| {
            maps::ALL_PROGRAMS
                .iter()
                .filter(|full| kernel_keeps(full) == kernel)
                .count()
        };
        assert_eq!(matches("tc_underlay"), 1);
        // Every program keeps a name no other shares.
        for name in maps::ALL_PROGRAMS {
            assert_eq!(matches(kernel_keeps(name)), 1, "{name}");
        }
    }
}
