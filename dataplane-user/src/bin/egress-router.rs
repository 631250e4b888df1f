//! `egress-router`: the CNI plugin of egress router pods (`type: egress-router` in a
//! NetworkAttachmentDefinition; see `dataplane_user::egressrouter`).

use dataplane_user::{cni::plugin::main_of, egressrouter::plugin};

fn main() -> std::process::ExitCode {
    main_of(plugin::run)
}
