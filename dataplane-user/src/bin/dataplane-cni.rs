//! `dataplane-cni`: the CNI plugin the container runtime runs for every pod. It asks the
//! node's dataplane agent to wire the pod (see `dataplane_user::cni`).

use std::{io::Read as _, process::ExitCode};

use dataplane_user::cni::plugin;

fn main() -> ExitCode {
    let mut stdin = Vec::new();
    let outcome = match std::io::stdin().read_to_end(&mut stdin) {
        Ok(_) => plugin::run(&|name| std::env::var(name).ok(), &stdin),
        Err(error) => plugin::Outcome {
            output: Some(
                dataplane_user::cni::spec::CniError::new(
                    dataplane_user::cni::spec::code::IO_FAILURE,
                    format!("reading the network configuration from stdin: {error}"),
                )
                .to_json(dataplane_user::cni::spec::LATEST_VERSION),
            ),
            success: false,
        },
    };
    if let Some(output) = outcome.output {
        println!("{output}");
    }
    if outcome.success {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
