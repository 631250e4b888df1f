//! `egress-router`: the CNI plugin of egress router pods (`type: egress-router` in a
//! NetworkAttachmentDefinition; see `dataplane_user::egressrouter`).

use std::{io::Read as _, process::ExitCode};

use dataplane_user::{
    cni::{plugin::Outcome, spec},
    egressrouter::plugin,
};

fn main() -> ExitCode {
    let mut stdin = Vec::new();
    let outcome = match std::io::stdin().read_to_end(&mut stdin) {
        Ok(_) => plugin::run(&|name| std::env::var(name).ok(), &stdin),
        Err(error) => Outcome {
            output: Some(
                spec::CniError::new(
                    spec::code::IO_FAILURE,
                    format!("reading the network configuration from stdin: {error}"),
                )
                .to_json(spec::LATEST_VERSION),
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
