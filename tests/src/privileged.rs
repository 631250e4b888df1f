//! Privileged tests run for real or fail: under `CI=true` a test that cannot reach the kernel
//! fails with the reason; elsewhere (a developer without root) it says so and returns early.

/// Whether this process can load BPF programs and create namespaces. Panics when it cannot and
/// `CI=true`, so CI never reports a skipped privileged test as passed.
pub fn privileged(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if root {
        return true;
    }
    let reason = format!("{test}: needs root (BPF, netns, veth)");
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{reason}; CI=true, so this is a failure, not a skip");
    }
    eprintln!("NOT RUN: {reason}");
    false
}
