//! docs/architecture.md kept in step with the code: its module map lists every module file of
//! the three crates (and nothing that is gone), its map table every map `maps.rs` and `testbed.rs` name.

use std::{collections::BTreeSet, path::Path};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

fn architecture() -> String {
    std::fs::read_to_string(format!("{ROOT}/docs/architecture.md")).expect("docs/architecture.md")
}

/// The first cell of each table row, without its backticks.
fn first_cells(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|line| line.strip_prefix("| `"))
        .filter_map(|rest| rest.split_once('`'))
        .map(|(cell, _)| cell.to_owned())
        .collect()
}

/// Every module file of `crate_dir/src`, as `crate/src/path.rs`; tests beside the code left out.
fn module_files(crate_dir: &str) -> BTreeSet<String> {
    fn walk(dir: &Path, root: &Path, out: &mut BTreeSet<String>, crate_dir: &str) {
        for entry in std::fs::read_dir(dir).expect("source directory") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                walk(&path, root, out, crate_dir);
                continue;
            }
            let relative = path.strip_prefix(root).expect("under the root");
            let relative = relative.to_string_lossy();
            let is_test = relative.ends_with("_tests.rs")
                || relative.ends_with("/tests.rs")
                || relative == "test_rng.rs";
            if relative.ends_with(".rs") && !is_test {
                out.insert(format!("{crate_dir}/src/{relative}"));
            }
        }
    }
    let root = Path::new(ROOT).join(crate_dir).join("src");
    let mut out = BTreeSet::new();
    walk(&root, &root, &mut out, crate_dir);
    out
}

#[test]
fn the_module_map_lists_every_module_file_and_no_other() {
    let listed: BTreeSet<String> = first_cells(&architecture())
        .into_iter()
        .filter(|cell| cell.ends_with(".rs"))
        .collect();
    let present: BTreeSet<String> = ["dataplane-common", "dataplane-ebpf", "dataplane-user"]
        .into_iter()
        .flat_map(module_files)
        .collect();
    let missing: Vec<_> = present.difference(&listed).collect();
    let gone: Vec<_> = listed.difference(&present).collect();
    assert!(
        missing.is_empty() && gone.is_empty(),
        "docs/architecture.md's module map: not listed {missing:?}; listed but gone {gone:?}"
    );
}

#[test]
fn the_map_table_lists_every_map_and_no_other() {
    // The dataplane's maps and the test bed's.
    let maps_rs = ["maps.rs", "testbed.rs"]
        .map(|file| {
            std::fs::read_to_string(format!("{ROOT}/dataplane-common/src/{file}")).expect(file)
        })
        .join("\n");
    let named: BTreeSet<String> = maps_rs
        .lines()
        .filter_map(|line| line.trim().strip_prefix("pub const "))
        .filter_map(|rest| rest.split_once(": &str = \""))
        .filter_map(|(_, value)| value.strip_suffix("\";"))
        .filter(|name| name.starts_with("DP_"))
        .map(str::to_owned)
        .collect();
    assert!(named.len() > 40, "maps.rs read: {named:?}");
    let listed: BTreeSet<String> = first_cells(&architecture())
        .into_iter()
        .filter(|cell| cell.starts_with("DP_"))
        .collect();
    let missing: Vec<_> = named.difference(&listed).collect();
    let gone: Vec<_> = listed.difference(&named).collect();
    assert!(
        missing.is_empty() && gone.is_empty(),
        "docs/architecture.md's maps: not listed {missing:?}; listed but not in maps.rs {gone:?}"
    );
}

/// The long options `dataplane <command> --help` lists.
fn flags_of(command: &str) -> BTreeSet<String> {
    let out = std::process::Command::new(dataplane_tests::topology::dataplane_binary())
        .args([command, "--help"])
        .output()
        .expect("dataplane --help");
    assert!(out.status.success(), "dataplane {command} --help");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.trim_start().strip_prefix("--"))
        .filter_map(|rest| rest.split([' ', '<']).next())
        .filter(|flag| *flag != "help")
        .map(|flag| format!("--{flag}"))
        .collect()
}

#[test]
fn the_readme_lists_every_flag_of_the_agent_and_the_controller() {
    let readme = std::fs::read_to_string(format!("{ROOT}/README.md")).expect("README.md");
    let listed = first_cells(&readme);
    for command in ["run", "controller"] {
        let flags = flags_of(command);
        assert!(flags.len() > 5, "{command}: {flags:?}");
        let missing: Vec<_> = flags.difference(&listed).collect();
        assert!(
            missing.is_empty(),
            "README's Configuration lacks `dataplane {command}` flags {missing:?}"
        );
    }
}

/// The README's YAML: every object of every `yaml` block decodes with the agent's own types
/// and validation (nothing refused; an egress router's NetworkAttachmentDefinition with the
/// egress-router plugin's, an EgressRouter with the controller's), and the deploy/ manifests it tells users to apply exist.
#[test]
fn the_readmes_yaml_decodes_with_the_agents_own_types() {
    let readme = std::fs::read_to_string(format!("{ROOT}/README.md")).expect("README.md");
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in readme.lines() {
        match (&mut current, line.trim_start()) {
            (None, "```yaml") => current = Some(String::new()),
            (Some(block), "```") => {
                blocks.push(std::mem::take(block));
                current = None;
            }
            (Some(block), _) => {
                block.push_str(line);
                block.push('\n');
            }
            (None, _) => {}
        }
    }
    assert!(!blocks.is_empty(), "the README has YAML blocks");
    for (index, block) in blocks.iter().enumerate() {
        // An egress router's attachment: its configuration is the egress-router plugin's.
        if block.contains("kind: NetworkAttachmentDefinition") {
            let object: serde_yaml::Value = serde_yaml::from_str(block).expect("YAML");
            let config = object["spec"]["config"].as_str().expect("spec.config");
            let parsed = dataplane_user::egressrouter::config::parse(config.as_bytes());
            assert!(parsed.is_ok(), "block {index}: {parsed:?}");
            continue;
        }
        let mut state = dataplane_user::source::ClusterState::default();
        dataplane_user::source::add_documents(&mut state, &format!("README block {index}"), block);
        assert!(
            state.rejected.is_empty(),
            "block {index}: {:?}",
            state.rejected
        );
        // An EgressRouter: the controller makes its objects without a refusal.
        if let Some(router) = state.egress_routers.first() {
            let planned = dataplane_user::egressrouter::resource::plan(
                router,
                dataplane_user::egressrouter::resource::DEFAULT_IMAGE,
            );
            assert!(planned.is_ok(), "block {index}: {planned:?}");
            continue;
        }
        assert!(
            state.network.is_some(),
            "block {index} configures the cluster"
        );
        assert!(!state.nodes.is_empty() && !state.services.is_empty());
    }
    for line in readme.lines() {
        for file in line
            .split_whitespace()
            .filter_map(|word| word.strip_prefix("deploy/"))
            .map(|rest| rest.trim_end_matches(|c: char| !c.is_ascii_alphanumeric() && c != '/'))
            .filter(|rest| rest.ends_with(".yaml") || rest.ends_with('/'))
        {
            let path = format!("{ROOT}/deploy/{file}");
            assert!(Path::new(&path).exists(), "the README names {path}");
        }
    }
}
