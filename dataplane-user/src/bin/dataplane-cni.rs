//! `dataplane-cni`: the CNI plugin the container runtime runs for every pod. It asks the
//! node's dataplane agent to wire the pod (see `dataplane_user::cni`).

use dataplane_user::cni::plugin;

fn main() -> std::process::ExitCode {
    plugin::main_of(plugin::run)
}
