//! `cargo xtask crds`: rewrites `deploy/crds/` from the agent's types (`dataplane crds
//! --write`). The test `the_shipped_crds_are_the_ones_generated_from_the_types` only compares,
//! so a run of the tests never blesses its own output.

pub fn run() -> anyhow::Result<()> {
    let dir = crate::workspace_root().join("deploy/crds");
    crate::run_test_profile(
        "dataplane-user",
        "dataplane",
        &[
            "crds".to_owned(),
            "--write".to_owned(),
            dir.display().to_string(),
        ],
    )
}
