//! `dataplane`: the node agent and its operator commands.

mod cluster;

mod agent;
mod args;
mod controller;

use std::{path::PathBuf, process::ExitCode};

use agent::{RunArgs, SourceArg, run};
use anyhow::Context as _;
use args::{Cli, Command, LogFormat, RunOptions};
use clap::Parser as _;
use controller::run_controller;
use dataplane_user::{
    Pins, acl, cli::inspect, cli::status, cli::trace, cni, egressip, kernel::state, kernel::verify,
};

fn main() -> ExitCode {
    let pages = dataplane_user::small_pages_only();
    let cli = Cli::parse();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr);
    match cli.log_format {
        // One JSON object per event, its fields as keys: for log collectors.
        LogFormat::Json => logs.json().init(),
        // Colour codes only for a terminal: log files get plain text.
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
    if let Err(error) = pages {
        tracing::debug!(%error, "transparent huge pages stay as the kernel sets them");
    }
    match dispatch(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// The `crds` subcommand: every shipped CRD to standard output, or each to its file in `dir`.
fn print_or_write_crds(dir: Option<&std::path::Path>) -> anyhow::Result<()> {
    for (file, crd) in dataplane_user::crds::shipped() {
        let yaml =
            dataplane_user::crds::to_yaml(&crd).with_context(|| format!("encoding {file}"))?;
        match dir {
            Some(dir) => {
                let path = dir.join(&file);
                std::fs::write(&path, yaml)
                    .with_context(|| format!("writing {}", path.display()))?;
                println!("wrote {}", path.display());
            }
            None => print!("---\n{yaml}"),
        }
    }
    Ok(())
}

fn dispatch(cli: Cli) -> anyhow::Result<()> {
    let pins = Pins::new(&cli.pin_root);
    match cli.command {
        Command::Run(options) => {
            let RunOptions {
                underlay,
                pod_ifaces,
                uplink_hook,
                xdp_mode,
                xdp_forward,
                manifests,
                kubernetes,
                kubeconfig,
                node_name,
                dns_server,
                audit_log,
                metrics_address,
                healthz_address,
                cni_socket,
                ipam_file,
                cni_netns_dirs,
                external_ip_cidrs,
                nodeport_addresses,
                network_config,
                proc_sys_dir,
                cni_conf_dir,
                egress_router_reservations,
                socket_lb,
                socket_lb_cgroup,
                socket_lb_host,
                capacities,
                look_every_seconds,
                full_sync_every_seconds,
                multicast_query_interval_seconds,
                multicast_port,
                probe_port,
                probe_key_file,
            } = *options;
            dataplane_user::kernel::sysctl::set_root(&proc_sys_dir);
            run(
                &pins,
                &cli.run_dir,
                &RunArgs {
                    underlay,
                    pod_ifaces,
                    uplink_hook,
                    xdp_mode,
                    xdp_forward,
                    probe_port,
                    probe_key_file: probe_key_file.unwrap_or_else(|| match &manifests {
                        Some(dir) => dir.join(egressip::probe::MANIFEST_KEY_FILE),
                        None => PathBuf::from(egressip::probe::DEFAULT_KEY_FILE),
                    }),
                    cluster: match (manifests, kubernetes) {
                        (Some(dir), _) => node_name.map(|node| (SourceArg::Manifests(dir), node)),
                        (None, true) => {
                            node_name.map(|node| (SourceArg::Kubernetes(kubeconfig), node))
                        }
                        (None, false) => None,
                    },
                    dns_server,
                    audit_log,
                    metrics_address,
                    healthz_address,
                    cni_socket: cni_socket.unwrap_or_else(|| cli.run_dir.join(cni::SOCKET_FILE)),
                    ipam_file,
                    cni_netns_dirs,
                    network_config,
                    external_ip_cidrs,
                    // Each value was checked as clap read it.
                    nodeport_addresses: dataplane_user::lb::NodePortAddresses::parse(
                        &nodeport_addresses,
                    )
                    .map_err(anyhow::Error::msg)?,
                    cni_conf_dir,
                    egress_router_reservations,
                    socket_lb,
                    socket_lb_cgroup,
                    socket_lb_host,
                    capacities,
                    look_every: std::time::Duration::from_secs(look_every_seconds.max(1)),
                    full_every: std::time::Duration::from_secs(full_sync_every_seconds),
                    multicast: dataplane_user::multicast::Settings {
                        query_interval: std::time::Duration::from_secs(
                            multicast_query_interval_seconds,
                        ),
                        peer_port: multicast_port,
                        ..Default::default()
                    },
                },
            )
        }
        Command::Controller(options) => run_controller(*options),
        Command::Crds { write } => print_or_write_crds(write.as_deref()),
        Command::PreparePins => {
            pins.prepare()?;
            println!(
                "pin root {} ready on a bpf filesystem",
                pins.root().display()
            );
            Ok(())
        }
        Command::InstallCni { bin_dir, plugin } => {
            let plugins = match plugin {
                Some(plugin) => vec![(plugin, "dataplane-cni")],
                None => {
                    let here = std::env::current_exe().context("locating this binary")?;
                    vec![
                        (here.with_file_name("dataplane-cni"), "dataplane-cni"),
                        (here.with_file_name("egress-router"), "egress-router"),
                    ]
                }
            };
            for (plugin, name) in plugins {
                let installed =
                    cni::install_plugin(&plugin, &bin_dir, name).with_context(|| {
                        format!("installing {} into {}", plugin.display(), bin_dir.display())
                    })?;
                println!("installed {}", installed.display());
            }
            Ok(())
        }
        Command::Status { json } => {
            let report = status::collect(&pins, &cli.run_dir)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", status::render(&report));
            }
            Ok(())
        }
        Command::Inspect { table, json } => {
            let rows = match table {
                inspect::Table::Multicast => inspect::multicast_rows(&pins, Some(&cli.run_dir))?,
                inspect::Table::Services => inspect::services_rows(
                    &pins,
                    &dataplane_user::lb::read_described(&cli.run_dir),
                )?,
                _ => inspect::read(&pins, table, &acl::explain::read(&cli.run_dir))?,
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&rows.to_json())?);
            } else {
                print!("{}", inspect::render(&rows));
            }
            Ok(())
        }
        Command::Trace {
            from,
            to,
            protocol,
            source_port,
            json,
        } => {
            let (to, port) = match to.parse::<std::net::SocketAddr>() {
                Ok(address) => (address.ip(), address.port()),
                Err(_) => match to.parse::<std::net::IpAddr>() {
                    Ok(ip) if protocol == trace::Protocol::Icmp => (ip, 0),
                    _ => anyhow::bail!(
                        "--to {to:?}: expected IP:port ([IPv6]:port), or an IP for ICMP"
                    ),
                },
            };
            let report = trace::trace(
                &pins,
                &trace::Described {
                    from,
                    to,
                    protocol,
                    source_port,
                    port,
                },
                &acl::explain::read(&cli.run_dir),
            )?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", trace::render(&report));
            }
            Ok(())
        }
        Command::Verify {
            json,
            max_budget_percent,
            max_stack,
        } => {
            let budgets = verify::measure()?;
            if json {
                println!("{}", serde_json::to_string_pretty(&budgets)?);
            } else {
                print!("{}", verify::render(&budgets));
            }
            let over: Vec<String> = budgets
                .iter()
                .filter(|b| {
                    max_budget_percent.is_some_and(|max| b.budget_percent > max)
                        || max_stack.is_some_and(|max| b.stack_bytes > max)
                })
                .map(|b| {
                    format!(
                        "{} ({:.1}%, {} bytes of stack)",
                        b.name, b.budget_percent, b.stack_bytes
                    )
                })
                .collect();
            if !over.is_empty() {
                anyhow::bail!(
                    "over the verifier margin (at most {}% of the budget, {} bytes of stack): {}",
                    max_budget_percent.map_or("-".into(), |m| m.to_string()),
                    max_stack.map_or("-".into(), |m| m.to_string()),
                    over.join(", ")
                );
            }
            Ok(())
        }
        Command::Cleanup => {
            let cleaned = dataplane_user::kernel::attach::remove_pod_filters();
            if let Err(error) = dataplane_user::gateway::remove() {
                tracing::warn!(%error, "removing the gateway SNAT table");
            }
            if let Err(error) = dataplane_user::lb::remove_host_table() {
                tracing::warn!(%error, "removing the host services table");
            }
            pins.remove_all()?;
            state::remove(&cli.run_dir);
            println!(
                "removed pins under {} and the pod tc filters of {} interfaces",
                pins.root().display(),
                cleaned.len()
            );
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The DaemonSet's agent arguments are ones this binary takes, the map sizes at their
    /// stated defaults.
    #[test]
    fn the_daemonsets_agent_arguments_parse_with_the_map_sizes_at_their_defaults() {
        let text = include_str!("../../../../deploy/daemonset.yaml");
        let daemonset: k8s_openapi::api::apps::v1::DaemonSet =
            serde_yaml::from_str(text).expect("DaemonSet");
        let spec = daemonset
            .spec
            .expect("spec")
            .template
            .spec
            .expect("pod spec");
        let agent = spec
            .containers
            .iter()
            .find(|c| c.name == "agent")
            .expect("agent container");
        let args = agent.args.iter().flatten().map(|a| {
            a.replace("$(NODE_NAME)", "node0")
                .replace("$(UNDERLAY)", "eth0")
        });
        let cli = Cli::try_parse_from(std::iter::once("dataplane".to_owned()).chain(args))
            .unwrap_or_else(|e| panic!("{e}"));
        let Command::Run(options) = cli.command else {
            panic!("the agent runs `dataplane run`");
        };
        assert_eq!(
            options.capacities,
            dataplane_user::kernel::capacity::Capacities::default()
        );
    }

    /// The init container's and the controller's arguments parse whole too, each as the
    /// subcommand it is meant to run.
    #[test]
    fn the_install_and_controller_arguments_parse() {
        let parse = |args: &[String]| {
            Cli::try_parse_from(std::iter::once("dataplane").chain(args.iter().map(String::as_str)))
                .unwrap_or_else(|e| panic!("{args:?}: {e}"))
        };
        let daemonset: k8s_openapi::api::apps::v1::DaemonSet =
            serde_yaml::from_str(include_str!("../../../../deploy/daemonset.yaml"))
                .expect("DaemonSet");
        let pod = daemonset
            .spec
            .expect("spec")
            .template
            .spec
            .expect("pod spec");
        let install = pod
            .init_containers
            .iter()
            .flatten()
            .find(|c| c.name == "install-cni")
            .and_then(|c| c.args.clone())
            .expect("install-cni args");
        assert!(matches!(
            parse(&install).command,
            Command::InstallCni { bin_dir, plugin: None } if bin_dir == std::path::Path::new("/host/opt/cni/bin")
        ));
        let controller_yaml = include_str!("../../../../deploy/controller.yaml");
        let deployment = serde_yaml::Deserializer::from_str(controller_yaml)
            .filter_map(|document| {
                let value =
                    <serde_yaml::Value as serde::Deserialize>::deserialize(document).ok()?;
                (value["kind"] == "Deployment").then_some(value)
            })
            .next()
            .expect("the controller's Deployment");
        let deployment: k8s_openapi::api::apps::v1::Deployment =
            serde_yaml::from_value(deployment).expect("Deployment");
        let args = deployment
            .spec
            .and_then(|s| s.template.spec)
            .and_then(|p| p.containers.into_iter().next())
            .and_then(|c| c.args)
            .expect("controller args");
        assert!(matches!(parse(&args).command, Command::Controller(_)));
    }
}
