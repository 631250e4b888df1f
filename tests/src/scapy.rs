//! Scapy as the independent Geneve implementation: builds the packets our programs must
//! produce and decodes what they did produce (`tests/scripts/geneve.py`).

use std::{
    io::Write as _,
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};
use serde_json::Value;

/// Sends one JSON request to the scapy script and returns its JSON answer.
pub fn call(request: &Value) -> anyhow::Result<Value> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/geneve.py");
    let mut child = Command::new("python3")
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting python3 (scapy)")?;
    child
        .stdin
        .take()
        .context("scapy stdin")?
        .write_all(request.to_string().as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!("scapy: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex from scapy"))
        .collect()
}

/// The bytes of a `{"hex": ...}` answer.
pub fn bytes_of(answer: &Value) -> Vec<u8> {
    unhex(answer["hex"].as_str().expect("hex field"))
}

/// The frame scapy builds from `expr` (a scapy expression such as
/// `Ether(src=...)/ARP(op=2, psrc=...)`): ARP, neighbour discovery and the like encoded by an
/// implementation independent of ours.
pub fn build(expr: &str) -> anyhow::Result<Vec<u8>> {
    Ok(bytes_of(&call(
        &serde_json::json!({"op": "build", "expr": expr}),
    )?))
}

/// [`build`] for many expressions in one run of the interpreter.
pub fn build_many(exprs: &[String]) -> anyhow::Result<Vec<Vec<u8>>> {
    let answer = call(&serde_json::json!({"op": "build_many", "exprs": exprs}))?;
    answer["hex"]
        .as_array()
        .context("hex list")?
        .iter()
        .map(|h| h.as_str().map(unhex).context("hex string"))
        .collect()
}
