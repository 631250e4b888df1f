//! Attaching the programs: XDP on the underlay NIC (native, then generic, as the operator
//! allows) and tc on the host side of pod veths. Every attachment stays
//! in force while no agent runs, and a restarted or upgraded agent swaps its programs in place,
//! atomically: no packet sees the hook empty.
//!
//! - The underlay's XDP and tc programs are bpf links pinned under the pin root (tcx for tc);
//!   the next agent swaps its programs into them (`BPF_LINK_UPDATE`).
//! - The pods' veths carry tc filters (`clsact`, priority [`POD_FILTER_PRIORITY`], handle
//!   [`POD_FILTER_HANDLE`], direct action) instead: a tcx attach waits out an RCU grace period
//!   under the RTNL lock (16 ms each here, two per pod, one pod after the other), which made
//!   pod creation wait on it (ADD p99 449 ms for 10 pods at once); a filter is in place in
//!   about a millisecond. The filter holds its program, so it outlives the agent as a pinned
//!   link does, and the next agent replaces the program in the filter (`RTM_NEWTFILTER`
//!   without `NLM_F_CREATE`), which the kernel swaps atomically.

use std::path::Path;

use aya::programs::{
    CgroupAttachMode, CgroupSockAddr, ProgramError, TcAttachType, XdpMode,
    links::{FdLink, LinkError, PinnedLink},
    tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcError},
    xdp::XdpLink,
};
use dataplane_common::{
    Hook,
    maps::{PROG_FROM_POD, PROG_TO_POD, PROG_UNDERLAY, PROG_UNDERLAY_TC, SOCK_PROGRAMS},
};
use serde::{Deserialize, Serialize};

use crate::{
    error::AgentError,
    error::{AttachAttempt, error_chain},
    kernel::loader::Dataplane,
    kernel::{netdev, preflight},
};

/// The priority of the pods' tc filters (both directions).
pub const POD_FILTER_PRIORITY: u16 = 1;
/// The handle of the pods' tc filters.
pub const POD_FILTER_HANDLE: u32 = 0xd9;

/// The XDP modes the operator allows, as on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum XdpModeChoice {
    /// Native (driver) if the NIC's driver runs XDP, else generic (skb).
    Auto,
    /// Driver mode only.
    Native,
    /// Generic (skb) mode only.
    Generic,
}

// No hardware offload mode: a program is offloaded only when it is loaded for the device
// (`prog_ifindex` at load), which the loader does not do, and these programs use what no
// offloading NIC runs (tail calls, LPM tries, per-CPU maps, redirects). Trying it at every
// start only failed: `auto` tries what can work.

impl XdpModeChoice {
    /// The modes to try, best first.
    pub fn candidates(self) -> &'static [XdpMode] {
        match self {
            XdpModeChoice::Auto => &[XdpMode::Driver, XdpMode::Skb],
            XdpModeChoice::Native => &[XdpMode::Driver],
            XdpModeChoice::Generic => &[XdpMode::Skb],
        }
    }
}

/// Where the uplink's own datapath runs (`--uplink-hook`): Geneve and VXLAN decapsulation,
/// NodePort and external traffic, delivery into local pods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum UplinkHook {
    /// tc on veth, virtio_net and tun uplinks, on a driver that cannot be read, and where the
    /// driver refuses native XDP; native XDP (then tc for what it passes up) elsewhere.
    Auto,
    /// XDP in the modes `--xdp-mode` allows, then tc for what XDP passes up.
    Xdp,
    /// tc only: no XDP program on the uplink.
    Tc,
}

/// Drivers on which `--uplink-hook auto` picks tc: XDP on them pays per frame for what tc
/// gets free. A veth copies every socket buffer with less than 256 bytes of headroom into a
/// page for XDP and builds a new one after it; virtio_net runs XDP only with its receive
/// offloads off; tun runs it on a copy.
const TC_DRIVERS: &[&str] = &["veth", "virtio_net", "tun"];

/// Operator-facing name of an XDP mode.
pub fn mode_name(mode: XdpMode) -> &'static str {
    match mode {
        XdpMode::Default => "default",
        XdpMode::Skb => "generic",
        XdpMode::Driver => "native",
        XdpMode::Hardware => "offload",
    }
}

/// One program attached to one interface, as reported by `dataplane status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    pub interface: String,
    pub ifindex: u32,
    pub program: String,
    pub hook: String,
    /// XDP mode (native/generic) or the tc direction.
    pub mode: String,
    /// Why this mode: the better modes the kernel or driver refused, with their errors (an
    /// `auto` attachment that fell back), or that a previous agent's link was taken over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

impl Dataplane {
    /// Attaches the underlay XDP program to `interface` in the best mode `choice` allows. A link
    /// a previous agent pinned there in an allowed mode is taken over: this agent's program is
    /// swapped in atomically, so no packet meets an interface without XDP.
    pub fn attach_underlay(
        &mut self,
        interface: &str,
        choice: XdpModeChoice,
    ) -> Result<Attachment, AgentError> {
        let ifindex = preflight::interface_index(interface)?;
        let attachment = |mode: XdpMode, why: Option<String>| Attachment {
            interface: interface.into(),
            ifindex,
            program: PROG_UNDERLAY.into(),
            hook: Hook::Underlay.name().into(),
            mode: mode_name(mode).into(),
            why,
        };
        for &mode in choice.candidates() {
            let pin = self
                .pins()
                .link(&link_name(PROG_UNDERLAY, ifindex, Some(mode)));
            if pin.exists() && self.take_over_xdp(&pin, interface) {
                return Ok(attachment(
                    mode,
                    Some("the previous agent's link, taken over".into()),
                ));
            }
        }
        // Links left in a mode the operator no longer allows, or whose interface went away.
        self.unpin_links(PROG_UNDERLAY, ifindex);
        let mut attempts = Vec::new();
        for &mode in choice.candidates() {
            let program = self.xdp(PROG_UNDERLAY)?;
            match program.attach_to_if_index(ifindex, mode) {
                Ok(id) => {
                    let link = program
                        .take_link(id)
                        .map_err(|source| AgentError::Program {
                            name: PROG_UNDERLAY,
                            action: "take its link",
                            source,
                        })?;
                    let pin = self
                        .pins()
                        .link(&link_name(PROG_UNDERLAY, ifindex, Some(mode)));
                    pin_link(FdLink::try_from(link), &pin, PROG_UNDERLAY, interface)?;
                    tracing::info!(interface, mode = mode_name(mode), "attached XDP");
                    let why = (!attempts.is_empty()).then(|| {
                        attempts
                            .iter()
                            .map(|a: &AttachAttempt| format!("{} refused: {}", a.step, a.error))
                            .collect::<Vec<_>>()
                            .join("; ")
                    });
                    return Ok(attachment(mode, why));
                }
                Err(e) => {
                    tracing::info!(interface, mode = mode_name(mode), error = %e, "XDP mode refused, trying the next");
                    attempts.push(AttachAttempt::new(mode_name(mode), e));
                }
            }
        }
        Err(AgentError::Attach {
            program: PROG_UNDERLAY,
            interface: interface.into(),
            attempts,
        })
    }

    /// Attaches the uplink's programs where `hook` says (XDP in the modes `xdp_mode` allows,
    /// and tc; or tc alone, any XDP link a previous agent left there removed). Each
    /// attachment says why the hook is the one it is.
    pub fn attach_uplink(
        &mut self,
        interface: &str,
        hook: UplinkHook,
        xdp_mode: XdpModeChoice,
    ) -> Result<Vec<Attachment>, AgentError> {
        let (xdp, mut why) = match hook {
            UplinkHook::Tc => (None, "--uplink-hook tc".to_owned()),
            UplinkHook::Xdp => (Some(xdp_mode), "--uplink-hook xdp".to_owned()),
            UplinkHook::Auto => match netdev::driver(interface) {
                Ok(driver) if TC_DRIVERS.contains(&driver.as_str()) => (
                    None,
                    format!(
                        "--uplink-hook auto: driver {driver}, where XDP costs a copy or a \
                         socket buffer build a frame"
                    ),
                ),
                Ok(driver) => (
                    Some(XdpModeChoice::Native),
                    format!("--uplink-hook auto: driver {driver}"),
                ),
                Err(error) => (
                    None,
                    format!("--uplink-hook auto: the driver cannot be read ({error})"),
                ),
            },
        };
        let mut attachments = Vec::new();
        match xdp {
            Some(choice) => match self.attach_underlay(interface, choice) {
                Ok(attachment) => attachments.push(attachment),
                Err(error) if hook == UplinkHook::Auto => {
                    tracing::warn!(interface, %error, "native XDP refused: the uplink runs tc alone");
                    why = format!("{why}, which refused native XDP ({error})");
                }
                Err(error) => return Err(error),
            },
            None => {
                let ifindex = preflight::interface_index(interface)?;
                // A link pinned by an agent that ran XDP here: unpinned, it detaches.
                self.unpin_links(PROG_UNDERLAY, ifindex);
            }
        }
        let mut tc = self.attach_underlay_tc(interface)?;
        let hook_name = if attachments.is_empty() { "tc" } else { "xdp" };
        tracing::info!(interface, hook = hook_name, why, "uplink hook");
        tc.why = Some(format!("uplink hook {hook_name}: {why}"));
        attachments.push(tc);
        Ok(attachments)
    }

    /// Attaches the from-pod tc program to the ingress of a pod's host-side veth, and the
    /// to-pod one to its egress, as tc filters (see the module's notes); a filter a previous
    /// agent left there gets this agent's program.
    pub fn attach_pod(&mut self, interface: &str) -> Result<Vec<Attachment>, AgentError> {
        let ifindex = preflight::interface_index(interface)?;
        if let Err(error) = tc::qdisc_add_clsact(interface)
            && !is_exists(&error)
        {
            return Err(AgentError::Attach {
                program: PROG_FROM_POD,
                interface: interface.into(),
                attempts: vec![AttachAttempt::new("adding the clsact qdisc", error)],
            });
        }
        let mut attachments = Vec::new();
        for (name, hook, direction, mode) in [
            (
                PROG_FROM_POD,
                Hook::FromPod,
                TcAttachType::Ingress,
                "tc-ingress",
            ),
            (PROG_TO_POD, Hook::ToPod, TcAttachType::Egress, "tc-egress"),
        ] {
            self.attach_pod_filter(name, interface, direction)?;
            // A tcx link an agent of an earlier release pinned for this pod: the filter now
            // does its work.
            self.unpin_links(name, ifindex);
            attachments.push(Attachment {
                interface: interface.into(),
                ifindex,
                program: name.into(),
                hook: hook.name().into(),
                mode: mode.into(),
                why: None,
            });
        }
        Ok(attachments)
    }

    /// Puts `name` into the pod filter of `interface` in `direction`: a new filter, or the
    /// program swapped into the one there.
    fn attach_pod_filter(
        &mut self,
        name: &'static str,
        interface: &str,
        direction: TcAttachType,
    ) -> Result<(), AgentError> {
        let attach_error = |e: Box<dyn std::error::Error + Send + Sync>| AgentError::Attach {
            program: name,
            interface: interface.into(),
            attempts: vec![AttachAttempt {
                step: "tc filter",
                error: e,
            }],
        };
        let program = self.classifier(name)?;
        let options = TcAttachOptions::Netlink(NlOptions {
            priority: POD_FILTER_PRIORITY,
            handle: POD_FILTER_HANDLE.into(),
            classid: None,
        });
        let id = match program.attach_with_options(interface, direction, options) {
            Ok(id) => {
                tracing::info!(interface, program = name, "attached tc filter");
                id
            }
            Err(ProgramError::TcError(error)) if is_exists(&error) => {
                let link = SchedClassifierLink::attached(
                    interface,
                    direction,
                    POD_FILTER_PRIORITY,
                    POD_FILTER_HANDLE.into(),
                    None,
                )
                .map_err(|e| attach_error(e.into()))?;
                let id = program
                    .attach_to_link(link)
                    .map_err(|e| attach_error(e.into()))?;
                tracing::info!(interface, program = name, "took over the tc filter");
                id
            }
            Err(error) => return Err(attach_error(error.into())),
        };
        let link = program.take_link(id).map_err(|e| attach_error(e.into()))?;
        // Dropping the link would remove the filter: it stays, holding the program, when this
        // agent exits, for the next to take over.
        std::mem::forget(link);
        Ok(())
    }

    /// Attaches the underlay tc program to the ingress of the underlay NIC (after XDP).
    pub fn attach_underlay_tc(&mut self, interface: &str) -> Result<Attachment, AgentError> {
        self.attach_tc(
            PROG_UNDERLAY_TC,
            Hook::UnderlayTc,
            interface,
            TcAttachType::Ingress,
        )
    }

    /// Attaches the socket-level service translation's programs to the cgroup v2 directory
    /// `cgroup` (the node's root: every socket of the node passes them; each program serves
    /// only the namespaces of this node's pods), beside any others there. Each link is
    /// pinned (`<program>@cgroup`), so the programs stay while no agent runs; a previous
    /// agent's links are released once this agent's are in place (for that moment both
    /// run, and the second finds the address already translated).
    pub fn attach_socket_lb(&mut self, cgroup: &Path) -> Result<Vec<Attachment>, AgentError> {
        let place = cgroup.display().to_string();
        let dir = std::fs::File::open(cgroup).map_err(|source| AgentError::Io {
            action: "opening the cgroup for the socket-level programs",
            path: cgroup.to_owned(),
            source,
        })?;
        let mut attachments = Vec::new();
        for &name in SOCK_PROGRAMS {
            let attach_error =
                |step, e: Box<dyn std::error::Error + Send + Sync>| AgentError::Attach {
                    program: name,
                    interface: place.clone(),
                    attempts: vec![AttachAttempt { step, error: e }],
                };
            let program: &mut CgroupSockAddr = self
                .ebpf_mut()
                .program_mut(name)
                .and_then(|p| p.try_into().ok())
                .ok_or(AgentError::MissingProgram { name })?;
            // A bpf link (what aya makes on Linux 5.7+) always sits beside the cgroup's other
            // programs; the kernel refuses any mode flag with one (EINVAL), so none is given.
            let id = program
                .attach(&dir, CgroupAttachMode::Single)
                .map_err(|e| attach_error("cgroup attach", e.into()))?;
            let link = program
                .take_link(id)
                .map_err(|e| attach_error("taking its link", e.into()))?;
            let pin = self.pins().link(&socket_link_name(name));
            remove_pin(&pin);
            pin_link(FdLink::try_from(link), &pin, name, &place)?;
            attachments.push(Attachment {
                interface: place.clone(),
                ifindex: 0,
                program: name.into(),
                hook: SOCKET_HOOK.into(),
                mode: "cgroup".into(),
                why: None,
            });
        }
        tracing::info!(cgroup = %place, "attached the socket-level service translation");
        Ok(attachments)
    }

    /// Releases the socket-level programs' pinned links (`--socket-lb off`): once the agent
    /// that attached them is gone too, the kernel detaches them.
    pub fn detach_socket_lb(&self) {
        for &name in SOCK_PROGRAMS {
            remove_pin(&self.pins().link(&socket_link_name(name)));
        }
    }

    /// Removes the pinned links of interfaces that no longer exist (deleted pods' veths): the
    /// kernel already detached them, only the pins are left.
    pub fn unpin_vanished_links(&self) {
        for name in self.pins().link_names() {
            let Some(pin) = LinkPin::parse(&name) else {
                continue;
            };
            if preflight::interface_name(pin.ifindex).is_none() {
                remove_pin(&self.pins().link(&name));
            }
        }
    }

    fn attach_tc(
        &mut self,
        name: &'static str,
        hook: Hook,
        interface: &str,
        direction: TcAttachType,
    ) -> Result<Attachment, AgentError> {
        let ifindex = preflight::interface_index(interface)?;
        let mode = match direction {
            TcAttachType::Egress => "tc-egress",
            _ => "tc-ingress",
        };
        let attachment = Attachment {
            interface: interface.into(),
            ifindex,
            program: name.into(),
            hook: hook.name().into(),
            mode: mode.into(),
            why: None,
        };
        let pin = self.pins().link(&link_name(name, ifindex, None));
        if pin.exists() && self.take_over_tc(name, &pin, interface) {
            return Ok(attachment);
        }
        let program = self.classifier(name)?;
        let attach_error = |e: ProgramError| AgentError::Attach {
            program: name,
            interface: interface.into(),
            attempts: vec![AttachAttempt::new(mode, e)],
        };
        let id = program.attach(interface, direction).map_err(attach_error)?;
        let link = program.take_link(id).map_err(attach_error)?;
        pin_link(FdLink::try_from(link), &pin, name, interface)?;
        tracing::info!(interface, program = name, mode, "attached");
        Ok(attachment)
    }

    /// Swaps the XDP program into the link pinned at `pin`. False (and the pin removed) when
    /// the link cannot be taken over, e.g. because its interface was deleted.
    fn take_over_xdp(&mut self, pin: &Path, interface: &str) -> bool {
        let swapped = open_link(pin).and_then(|link| {
            let link = XdpLink::try_from(link).map_err(|e| e.to_string())?;
            let program = self.xdp(PROG_UNDERLAY).map_err(|e| e.to_string())?;
            program.attach_to_link(link).map_err(|e| error_chain(&e))
        });
        took_over(swapped.map(|_| ()), pin, PROG_UNDERLAY, interface)
    }

    /// As [`Self::take_over_xdp`], for a tcx link.
    fn take_over_tc(&mut self, name: &'static str, pin: &Path, interface: &str) -> bool {
        let swapped = open_link(pin).and_then(|link| {
            let link = SchedClassifierLink::try_from(link).map_err(|e| e.to_string())?;
            let program = self.classifier(name).map_err(|e| e.to_string())?;
            program.attach_to_link(link).map_err(|e| error_chain(&e))
        });
        took_over(swapped.map(|_| ()), pin, name, interface)
    }

    /// Removes every pinned link of `program` on `ifindex`.
    fn unpin_links(&self, program: &str, ifindex: u32) {
        for name in self.pins().link_names() {
            if LinkPin::parse(&name).is_some_and(|p| p.program == program && p.ifindex == ifindex) {
                remove_pin(&self.pins().link(&name));
            }
        }
    }
}

/// The hook name `status` gives the socket-level programs.
pub const SOCKET_HOOK: &str = "socket";

/// The pin of a socket-level program's cgroup link.
fn socket_link_name(program: &str) -> String {
    format!("{program}@cgroup")
}

/// One pinned link, from its file name `<program>@<ifindex>[@<xdp mode>]`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LinkPin {
    pub program: String,
    pub ifindex: u32,
    pub mode: Option<String>,
}

impl LinkPin {
    pub fn parse(name: &str) -> Option<Self> {
        let mut parts = name.split('@');
        let program = parts.next()?.to_owned();
        let ifindex = parts.next()?.parse().ok()?;
        let mode = parts.next().map(str::to_owned);
        parts.next().is_none().then_some(Self {
            program,
            ifindex,
            mode,
        })
    }
}

fn link_name(program: &str, ifindex: u32, mode: Option<XdpMode>) -> String {
    match mode {
        Some(mode) => format!("{program}@{ifindex}@{}", mode_name(mode)),
        None => format!("{program}@{ifindex}"),
    }
}

fn open_link(pin: &Path) -> Result<FdLink, String> {
    PinnedLink::from_pin(pin)
        .map(FdLink::from)
        .map_err(|e| error_chain(&e))
}

/// Logs the outcome of a take-over; a link that could not be taken over is unpinned so that a
/// fresh one can be attached in its place.
fn took_over(outcome: Result<(), String>, pin: &Path, program: &str, interface: &str) -> bool {
    match outcome {
        Ok(()) => {
            tracing::info!(
                interface,
                program,
                "took over the pinned link (program swapped in place)"
            );
            true
        }
        Err(error) => {
            tracing::info!(
                interface,
                program,
                error,
                "pinned link not usable; attaching anew"
            );
            remove_pin(pin);
            false
        }
    }
}

/// Pins a new link so that it outlives this agent.
fn pin_link(
    link: Result<FdLink, LinkError>,
    pin: &Path,
    program: &'static str,
    interface: &str,
) -> Result<(), AgentError> {
    let link = link.map_err(|e| AgentError::Attach {
        program,
        interface: interface.into(),
        attempts: vec![AttachAttempt::new("pinning its link", e)],
    })?;
    link.pin(pin).map_err(|source| AgentError::Pin {
        path: pin.to_owned(),
        source,
    })?;
    Ok(())
}

/// Whether a tc operation failed because what it creates is already there.
fn is_exists(error: &TcError) -> bool {
    match error {
        TcError::NetlinkError(e) => e.raw_os_error() == Some(libc::EEXIST),
        TcError::IoError(e) => e.raw_os_error() == Some(libc::EEXIST),
        TcError::AlreadyAttached => true,
        _ => false,
    }
}

/// Removes this dataplane's pod filters from every interface of this network namespace (the
/// pods' veths and the management port): `dataplane cleanup`'s part beside the pins.
pub fn remove_pod_filters() -> Vec<String> {
    let mut cleaned = Vec::new();
    for interface in crate::kernel::netdev::interface_names() {
        let mut removed = false;
        for (name, direction) in [
            (PROG_FROM_POD, TcAttachType::Ingress),
            (PROG_TO_POD, TcAttachType::Egress),
        ] {
            removed |= tc::qdisc_detach_program(&interface, direction, name).is_ok();
        }
        if removed {
            cleaned.push(interface);
        }
    }
    cleaned
}

fn remove_pin(pin: &Path) {
    if let Err(error) = std::fs::remove_file(pin)
        && error.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(pin = %pin.display(), %error, "removing a pinned link");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_tries_native_then_generic() {
        let names: Vec<&str> = XdpModeChoice::Auto
            .candidates()
            .iter()
            .map(|m| mode_name(*m))
            .collect();
        assert_eq!(names, ["native", "generic"]);
        assert_eq!(XdpModeChoice::Native.candidates(), &[XdpMode::Driver]);
        assert_eq!(XdpModeChoice::Generic.candidates(), &[XdpMode::Skb]);
    }

    #[test]
    fn link_pin_names_round_trip() {
        let xdp = link_name("xdp_underlay", 7, Some(XdpMode::Driver));
        assert_eq!(xdp, "xdp_underlay@7@native");
        assert_eq!(
            LinkPin::parse(&xdp),
            Some(LinkPin {
                program: "xdp_underlay".into(),
                ifindex: 7,
                mode: Some("native".into())
            })
        );
        let tc = link_name("tc_from_pod", 12, None);
        assert_eq!(
            LinkPin::parse(&tc).map(|p| (p.program, p.ifindex, p.mode)),
            Some(("tc_from_pod".into(), 12, None))
        );
        assert_eq!(LinkPin::parse("tc_from_pod"), None);
        assert_eq!(LinkPin::parse("tc_from_pod@x"), None);
        assert_eq!(LinkPin::parse("a@1@b@c"), None);
    }
}
