//! The plugin binary's logic: the environment and stdin in, the agent asked, one JSON
//! document out (a result, or an error with a non-zero exit).

use std::{path::PathBuf, time::Duration};

use serde_json::Value;

use super::{
    DEFAULT_SOCKET,
    protocol::{self, Reply, Request, Target},
    spec::{self, CniError, Command, NetConf, code},
};

/// How long ADD (and the other commands) wait for the agent by default: it answers once the
/// pod's state is installed, which can wait behind a sync of the whole cluster.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// What the plugin prints, and whether it succeeded.
pub struct Outcome {
    pub output: Option<Value>,
    pub success: bool,
}

/// Runs one command as the runtime asked: `env` reads the `CNI_*` variables.
pub fn run(env: &dyn Fn(&str) -> Option<String>, stdin: &[u8]) -> Outcome {
    answer(stdin, || execute(env, stdin))
}

/// A plugin's answer to one command: `execute`'s output, or its error in the configuration's
/// version (the latest when `stdin` names none this plugin speaks).
pub fn answer(stdin: &[u8], execute: impl FnOnce() -> Result<Option<Value>, CniError>) -> Outcome {
    let version = serde_json::from_slice::<Value>(stdin)
        .ok()
        .and_then(|v| {
            v.get("cniVersion")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .filter(|v| spec::SUPPORTED_VERSIONS.contains(&v.as_str()))
        .unwrap_or_else(|| spec::LATEST_VERSION.to_owned());
    match execute() {
        Ok(output) => Outcome {
            output,
            success: true,
        },
        Err(error) => Outcome {
            output: Some(error.to_json(&version)),
            success: false,
        },
    }
}

/// A plugin's logic: the `CNI_*` variables (read through the function) and stdin in, one
/// answer out.
pub type Plugin = fn(&dyn Fn(&str) -> Option<String>, &[u8]) -> Outcome;

/// A plugin binary's `main`: stdin and the environment to `run`, its document printed, its
/// success the exit status.
pub fn main_of(run: Plugin) -> std::process::ExitCode {
    use std::io::Read as _;
    let mut stdin = Vec::new();
    let outcome = match std::io::stdin().read_to_end(&mut stdin) {
        Ok(_) => run(&|name| std::env::var(name).ok(), &stdin),
        Err(error) => Outcome {
            output: Some(
                CniError::new(
                    code::IO_FAILURE,
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
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
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
    let conf = NetConf::parse(stdin, command)?;
    let socket = conf
        .agent_socket
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET));
    let timeout = conf
        .agent_timeout_seconds
        .map_or(DEFAULT_TIMEOUT, Duration::from_secs);
    let required = |name: &str| {
        env(name).filter(|v| !v.is_empty()).ok_or_else(|| {
            CniError::new(
                code::INVALID_ENVIRONMENT,
                format!("{name} is not set; the container runtime must set it for {command_text}"),
            )
        })
    };
    let target = |netns_required: bool| -> Result<Target, CniError> {
        let target = Target {
            container_id: required("CNI_CONTAINERID")?,
            netns: if netns_required {
                Some(required("CNI_NETNS")?)
            } else {
                env("CNI_NETNS").filter(|v| !v.is_empty())
            },
            ifname: required("CNI_IFNAME")?,
            pod: spec::pod_from_args(&env("CNI_ARGS").unwrap_or_default())?,
        };
        // The agent checks again: this only names the fault before the socket is asked.
        target.check_names()?;
        Ok(target)
    };
    let call = |request: &Request, unreachable: u32| match protocol::call(
        &socket,
        request,
        timeout,
        unreachable,
    )? {
        Reply::Failed(error) => Err(error),
        reply => Ok(reply),
    };
    match command {
        Command::Add => {
            let reply = call(&Request::Add(target(true)?), code::TRY_AGAIN_LATER)?;
            let Reply::Attached(attachment) = reply else {
                return Err(unexpected(&reply));
            };
            Ok(Some(spec::result(&conf.cni_version, &attachment)))
        }
        Command::Check => {
            let prev = conf.prev_result.as_ref().ok_or_else(|| {
                CniError::new(
                    code::INVALID_CONFIG,
                    "CHECK needs prevResult: the result ADD gave",
                )
            })?;
            let expected = spec::previous_addresses(prev)?;
            let reply = call(&Request::Check(target(true)?), code::TRY_AGAIN_LATER)?;
            let Reply::Attached(attachment) = reply else {
                return Err(unexpected(&reply));
            };
            let mut have = attachment.addresses.clone();
            let mut want = expected;
            have.sort();
            want.sort();
            if have != want {
                return Err(CniError::new(
                    code::CHECK_FAILED,
                    format!("the pod has addresses {have:?}, prevResult says {want:?}"),
                ));
            }
            Ok(None)
        }
        Command::Del => {
            call(&Request::Del(target(false)?), code::TRY_AGAIN_LATER)?;
            Ok(None)
        }
        Command::Gc => {
            let valid = conf
                .valid_attachments
                .unwrap_or_default()
                .into_iter()
                .map(|a| (a.container_id, a.ifname))
                .collect();
            call(&Request::Gc(valid), code::TRY_AGAIN_LATER)?;
            Ok(None)
        }
        Command::Status => {
            call(&Request::Status, code::NOT_AVAILABLE)?;
            Ok(None)
        }
        Command::Version => unreachable!("answered above"),
    }
}

fn unexpected(reply: &Reply) -> CniError {
    CniError::new(
        code::TRY_AGAIN_LATER,
        format!("the agent answered {reply:?}; are the plugin and the agent of the same release?"),
    )
}
