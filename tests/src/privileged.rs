//! Privileged tests run for real or fail: under CI (any truthy `CI`) a test that cannot reach
//! the kernel fails with the reason; elsewhere (a developer without root) it says so, records
//! itself as not run, and returns early.

use std::io::Write as _;

/// Where `cargo xtask test` asks privileged tests that did not run to write their names, one a
/// line, so that its closing line can count them (libtest counts them as passed).
pub const NOT_RUN_LOG: &str = "DATAPLANE_NOT_RUN_LOG";

/// Whether this process can load BPF programs and create namespaces. Panics when it cannot
/// under CI, so CI never reports a skipped privileged test as passed.
pub fn privileged(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if root {
        return true;
    }
    let reason = format!("{test}: needs root (BPF, netns, veth)");
    if let Some(ci) = std::env::var_os("CI").filter(|v| is_truthy(&v.to_string_lossy())) {
        panic!("{reason}; CI={ci:?}, so this is a failure, not a skip");
    }
    eprintln!("NOT RUN: {reason}");
    record_not_run(test);
    false
}

/// Whether a `CI` value means "this is CI", as CI services and tools read it: anything but
/// empty, `0`, `false`, `no` or `off` (any case).
pub fn is_truthy(value: &str) -> bool {
    let value = value.trim().to_ascii_lowercase();
    !matches!(value.as_str(), "" | "0" | "false" | "no" | "off")
}

/// Appends the test's name to the not-run log, when one was asked for. One `write` of a whole
/// line to a file opened for appending, so tests in parallel processes do not interleave.
fn record_not_run(test: &str) {
    let Some(path) = std::env::var_os(NOT_RUN_LOG) else {
        return;
    };
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut file| file.write_all(format!("{test}\n").as_bytes()));
    if let Err(error) = written {
        // The count would then be short: say so loudly rather than let the run look whole.
        panic!("{test}: cannot record it as not run in {path:?}: {error}");
    }
}

#[cfg(test)]
mod tests {
    use super::is_truthy;

    #[test]
    fn any_ci_value_but_the_falsy_ones_is_ci() {
        for value in ["true", "TRUE", "1", "yes", "on", "github-actions", " true "] {
            assert!(is_truthy(value), "{value:?}");
        }
        for value in ["", "0", "false", "False", "no", "off", " "] {
            assert!(!is_truthy(value), "{value:?}");
        }
    }
}
