//! The `egress-router` plugin binary's logic: the environment and stdin in, the router pod's
//! second interface made (or removed, or checked), one JSON document out. Nothing it makes is
//! in the node's maps; from the agent it needs only the reservations file (ADD claims only a
//! reserved address).

use std::path::Path;

use serde_json::Value;

use super::{config, reservations, wire};
use crate::cni::{
    names::{check_container_id, check_ifname},
    plugin::{self, Outcome},
    spec::{self, CniError, Command, code},
};

/// Runs one command as the runtime asked: `env` reads the `CNI_*` variables.
pub fn run(env: &dyn Fn(&str) -> Option<String>, stdin: &[u8]) -> Outcome {
    plugin::answer(stdin, || execute(env, stdin))
}

fn execute(env: &dyn Fn(&str) -> Option<String>, stdin: &[u8]) -> Result<Option<Value>, CniError> {
    let command_text = env("CNI_COMMAND").unwrap_or_default();
    let command = Command::parse(&command_text).ok_or_else(|| {
        CniError::new(
            code::INVALID_ENVIRONMENT,
            format!(
                "CNI_COMMAND {command_text:?} is not one of ADD, DEL, CHECK, STATUS, VERSION, GC"
            ),
        )
    })?;
    if command == Command::Version {
        return Ok(Some(spec::version_info()));
    }
    let conf = config::parse(stdin).map_err(|why| CniError::new(code::INVALID_CONFIG, why))?;
    let required = |name: &str| {
        env(name).filter(|v| !v.is_empty()).ok_or_else(|| {
            CniError::new(
                code::INVALID_ENVIRONMENT,
                format!("{name} is not set; the container runtime must set it for {command_text}"),
            )
        })
    };
    let names = |container_id: &str, ifname: &str| {
        check_container_id(container_id)
            .and_then(|()| check_ifname(ifname))
            .map_err(|why| CniError::new(code::INVALID_ENVIRONMENT, why))
    };
    match command {
        Command::Add | Command::Check => {
            let (container_id, netns, ifname) = (
                required("CNI_CONTAINERID")?,
                required("CNI_NETNS")?,
                required("CNI_IFNAME")?,
            );
            names(&container_id, &ifname)?;
            let target = wire::Target {
                container_id: &container_id,
                netns: Path::new(&netns),
                ifname: &ifname,
            };
            if command == Command::Add {
                let namespace = spec::pod_from_args(&env("CNI_ARGS").unwrap_or_default())?
                    .map(|pod| pod.namespace);
                check_reserved(env, namespace.as_deref(), conf.address.addr())?;
                wire::add(&conf, &target).map(Some)
            } else {
                wire::check(&conf, &target).map(|()| None)
            }
        }
        Command::Del => {
            let (container_id, ifname) = (required("CNI_CONTAINERID")?, required("CNI_IFNAME")?);
            names(&container_id, &ifname)?;
            let netns = env("CNI_NETNS").filter(|v| !v.is_empty());
            wire::del(&container_id, netns.as_deref().map(Path::new), &ifname).map(|()| None)
        }
        // Nothing is kept between commands: nothing to collect, always ready.
        Command::Gc | Command::Status => Ok(None),
        Command::Version => unreachable!("answered above"),
    }
}

/// Refuses an address no reservation gives the pod's namespace (see [`reservations`]).
fn check_reserved(
    env: &dyn Fn(&str) -> Option<String>,
    namespace: Option<&str>,
    address: std::net::IpAddr,
) -> Result<(), CniError> {
    let path = env(reservations::PATH_ENV)
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| reservations::DEFAULT_PATH.to_owned());
    let known = reservations::Reservations::read(Path::new(&path)).map_err(|why| {
        CniError::new(
            code::TRY_AGAIN_LATER,
            format!("the reservations the dataplane agent writes cannot be read ({why}); is the agent running on this node?"),
        )
    })?;
    if known.allow(namespace, address) {
        return Ok(());
    }
    let whose = namespace.map_or("a pod of no namespace".to_owned(), |n| {
        format!("namespace {n}")
    });
    Err(CniError::new(
        code::NOT_RESERVED,
        format!(
            "ip.addresses[0]: {address} is not reserved for {whose} (an EgressRouter of the namespace reserves its address; the agent's --egress-router-reservation others)"
        ),
    ))
}
