//! The agent's one-line errors for the mistakes operators make most.

use std::process::Command;

use dataplane_tests::{privileged::privileged, topology::dataplane_binary, unique_name};

/// Runs the agent binary with `args`; returns (exit code, stderr).
fn dataplane(prefix: &[&str], args: &[&str]) -> (Option<i32>, String) {
    let pin_root = format!("/sys/fs/bpf/{}", unique_name("cli"));
    let run_dir = std::env::temp_dir().join(unique_name("cli"));
    let mut command = if prefix.is_empty() {
        Command::new(dataplane_binary())
    } else {
        let mut c = Command::new(prefix[0]);
        c.args(&prefix[1..]).arg(dataplane_binary());
        c
    };
    let out = command
        .arg("--pin-root")
        .arg(&pin_root)
        .arg("--run-dir")
        .arg(&run_dir)
        .args(args)
        .env("RUST_LOG", "off")
        .output()
        .expect("run dataplane");
    let _ = std::fs::remove_dir_all(&pin_root);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn assert_one_line_error(stderr: &str, expected: &str) {
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line, got: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    assert!(
        lines[0].contains(expected),
        "expected {expected:?} in {stderr}"
    );
}

#[test]
fn missing_interface_is_named() {
    if !privileged("missing_interface_is_named") {
        return;
    }
    let (code, stderr) = dataplane(&[], &["run", "--underlay", "nosuch0"]);
    assert_eq!(code, Some(1));
    assert_one_line_error(&stderr, "interface \"nosuch0\" not found");
    let (code, stderr) = dataplane(&[], &["run", "--underlay", "lo", "--pod-iface", "nosuch1"]);
    assert_eq!(code, Some(1));
    assert_one_line_error(&stderr, "interface \"nosuch1\" not found");
}

#[test]
fn missing_privileges_say_what_to_do() {
    if !privileged("missing_privileges_say_what_to_do") {
        return;
    }
    // Drop to an unprivileged user with no capabilities, as a non-privileged pod would be.
    let drop_privileges = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
    ];
    let (code, stderr) = dataplane(&drop_privileges, &["run", "--underlay", "lo"]);
    assert_eq!(code, Some(1));
    assert_one_line_error(&stderr, "missing privileges");
    assert!(
        stderr.contains("run as root or as a privileged pod"),
        "{stderr}"
    );
}

#[test]
fn status_without_an_agent_reports_absent() {
    if !privileged("status_without_an_agent_reports_absent") {
        return;
    }
    let pin_root = format!("/sys/fs/bpf/{}", unique_name("cli"));
    let out = Command::new(dataplane_binary())
        .args([
            "--pin-root",
            &pin_root,
            "--run-dir",
            "/nonexistent/dataplane",
        ])
        .args(["status", "--json"])
        .output()
        .expect("run dataplane");
    assert!(out.status.success());
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(status["agent"], "absent");
    assert_eq!(status["maps"], serde_json::json!([]));
}

/// The deployment's DaemonSet passes arguments the agent accepts, all of them as shipped (the
/// variables expanded from the container's own env as the kubelet would, the underlay one set
/// to a missing interface): it gets as far as looking for the underlay. It runs in a mount
/// namespace of its own with a fresh bpffs and an empty /run, so the shipped pin root and run
/// directory are the agent's real ones and nothing of the host's is touched.
#[test]
fn the_daemonset_arguments_are_accepted() {
    if !privileged("the_daemonset_arguments_are_accepted") {
        return;
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/daemonset.yaml");
    let text = std::fs::read_to_string(path).expect("daemonset.yaml");
    let set: k8s_openapi::api::apps::v1::DaemonSet =
        serde_yaml::from_str(&text).expect("a DaemonSet");
    let agent = set
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|p| p.containers.into_iter().find(|c| c.name == "agent"))
        .expect("the agent container");
    // The container's variables: literal values as written, field references as the kubelet
    // fills them (the node's name), the underlay an interface this machine does not have.
    let env: Vec<(String, String)> = agent
        .env
        .iter()
        .flatten()
        .map(|var| {
            let value = match (var.name.as_str(), &var.value) {
                ("UNDERLAY", _) => "nosuch2".to_owned(),
                (_, Some(value)) => value.clone(),
                (_, None) => "node-a".to_owned(),
            };
            (var.name.clone(), value)
        })
        .collect();
    let args: Vec<String> = agent
        .args
        .expect("container args")
        .into_iter()
        .map(|arg| {
            let expanded = env.iter().fold(arg, |arg, (name, value)| {
                arg.replace(&format!("$({name})"), value)
            });
            assert!(
                !expanded.contains("$("),
                "{expanded}: a variable the container does not set"
            );
            expanded
        })
        .collect();
    assert!(
        args.iter().any(|a| a == "--pin-root=/sys/fs/bpf/dataplane")
            && args.iter().any(|a| a == "--run-dir=/run/dataplane"),
        "the shipped pin root and run dir are among the arguments: {args:?}"
    );
    let script = "mount -t bpf bpf /sys/fs/bpf && mount -t tmpfs tmpfs /run && exec \"$0\" \"$@\"";
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", script])
        .arg(dataplane_binary())
        .args(&args)
        .env("RUST_LOG", "off")
        .output()
        .expect("run dataplane");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_one_line_error(&stderr, "interface \"nosuch2\" not found");
}

/// `install-cni` (the DaemonSet's init container) puts the plugin binary into the runtime's
/// plugin directory, executable, and the installed plugin answers VERSION.
#[test]
fn install_cni_installs_a_working_plugin() {
    let dir = std::env::temp_dir().join(dataplane_tests::unique_name("cni-bin"));
    let bin_dir = dir.join("opt/cni/bin");
    let bin_arg = bin_dir.display().to_string();
    let (code, stderr) = dataplane(&[], &["install-cni", "--bin-dir", &bin_arg]);
    assert_eq!(code, Some(0), "{stderr}");
    let installed = bin_dir.join("dataplane-cni");
    let out = std::process::Command::new(&installed)
        .env_clear()
        .env("CNI_COMMAND", "VERSION")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run the installed plugin");
    assert!(out.status.success());
    let version: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(
        version["supportedVersions"],
        serde_json::json!(["0.4.0", "1.0.0", "1.1.0"])
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
