//! Attaching the programs: XDP on the underlay NIC (trying hardware offload, then native, then
//! generic, as the operator allows) and tc on the host side of pod veths.

use aya::programs::{TcAttachType, XdpMode};
use dataplane_common::{
    Hook,
    maps::{PROG_FROM_POD, PROG_TO_POD, PROG_UNDERLAY, PROG_UNDERLAY_TC},
};
use serde::{Deserialize, Serialize};

use crate::{AgentError, Dataplane, preflight};

/// The XDP modes the operator allows, as on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum XdpModeChoice {
    /// Offload if the NIC can, else native (driver), else generic (skb).
    Auto,
    /// Driver mode only.
    Native,
    /// Generic (skb) mode only.
    Generic,
    /// Hardware offload only (a hardware-offload hook for SmartNICs).
    Offload,
}

impl XdpModeChoice {
    /// The modes to try, best first.
    pub fn candidates(self) -> &'static [XdpMode] {
        match self {
            XdpModeChoice::Auto => &[XdpMode::Hardware, XdpMode::Driver, XdpMode::Skb],
            XdpModeChoice::Native => &[XdpMode::Driver],
            XdpModeChoice::Generic => &[XdpMode::Skb],
            XdpModeChoice::Offload => &[XdpMode::Hardware],
        }
    }
}

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
    /// XDP mode (offload/native/generic) or the tc direction.
    pub mode: String,
}

impl Dataplane {
    /// Attaches the underlay XDP program to `interface` in the best mode `choice` allows.
    pub fn attach_underlay(
        &mut self,
        interface: &str,
        choice: XdpModeChoice,
    ) -> Result<Attachment, AgentError> {
        let ifindex = preflight::interface_index(interface)?;
        let program = self.xdp(PROG_UNDERLAY)?;
        let mut attempts = Vec::new();
        for &mode in choice.candidates() {
            match program.attach_to_if_index(ifindex, mode) {
                Ok(_) => {
                    tracing::info!(interface, mode = mode_name(mode), "attached XDP");
                    return Ok(Attachment {
                        interface: interface.into(),
                        ifindex,
                        program: PROG_UNDERLAY.into(),
                        hook: Hook::Underlay.name().into(),
                        mode: mode_name(mode).into(),
                    });
                }
                Err(e) => {
                    tracing::info!(interface, mode = mode_name(mode), error = %e, "XDP mode refused, trying the next");
                    attempts.push(format!("{}: {}", mode_name(mode), error_chain(&e)));
                }
            }
        }
        Err(AgentError::Attach {
            program: PROG_UNDERLAY,
            interface: interface.into(),
            attempts: attempts.join("; "),
        })
    }

    /// Attaches the from-pod tc program to the ingress of a pod's host-side veth, and the
    /// to-pod one to its egress.
    pub fn attach_pod(&mut self, interface: &str) -> Result<Vec<Attachment>, AgentError> {
        Ok(vec![
            self.attach_tc(
                PROG_FROM_POD,
                Hook::FromPod,
                interface,
                TcAttachType::Ingress,
            )?,
            self.attach_tc(PROG_TO_POD, Hook::ToPod, interface, TcAttachType::Egress)?,
        ])
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

    fn attach_tc(
        &mut self,
        name: &'static str,
        hook: Hook,
        interface: &str,
        direction: TcAttachType,
    ) -> Result<Attachment, AgentError> {
        let ifindex = preflight::interface_index(interface)?;
        let program = self.classifier(name)?;
        let mode = match direction {
            TcAttachType::Egress => "tc-egress",
            _ => "tc-ingress",
        };
        program
            .attach(interface, direction)
            .map_err(|e| AgentError::Attach {
                program: name,
                interface: interface.into(),
                attempts: format!("{mode}: {}", error_chain(&e)),
            })?;
        tracing::info!(interface, program = name, mode, "attached");
        Ok(Attachment {
            interface: interface.into(),
            ifindex,
            program: name.into(),
            hook: hook.name().into(),
            mode: mode.into(),
        })
    }
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_tries_offload_then_native_then_generic() {
        let names: Vec<&str> = XdpModeChoice::Auto
            .candidates()
            .iter()
            .map(|m| mode_name(*m))
            .collect();
        assert_eq!(names, ["offload", "native", "generic"]);
        assert_eq!(XdpModeChoice::Native.candidates(), &[XdpMode::Driver]);
        assert_eq!(XdpModeChoice::Generic.candidates(), &[XdpMode::Skb]);
        assert_eq!(XdpModeChoice::Offload.candidates(), &[XdpMode::Hardware]);
    }
}
