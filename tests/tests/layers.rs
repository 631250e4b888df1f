//! The agent library's layers stay one-way: no module (a file at the crate root, or a folder
//! with its file) imports, through any chain, a module that imports it. docs/architecture.md's
//! layer table is the intended order; this holds the code to having one at all.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

const SRC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../dataplane-user/src");

/// The top-level modules of the library (`acl` for `acl.rs` and `acl/`), without the binaries.
fn modules() -> BTreeSet<String> {
    std::fs::read_dir(SRC)
        .expect("source directory")
        .filter_map(|entry| {
            let path = entry.expect("entry").path();
            let name = path.file_stem()?.to_str()?.to_owned();
            (name != "lib" && name != "bin" && name != "main").then_some(name)
        })
        .collect()
}

/// Every Rust file under `dir`, but tests beside the code.
fn files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("directory") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            if name != "tests.rs" && !name.ends_with("_tests.rs") {
                out.push(path);
            }
        }
    }
}

/// The top-level modules `text` names after `crate::`, directly or in a `use crate::{...}`
/// group (first level only).
fn imported(text: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    for (at, _) in text.match_indices("crate::") {
        let rest = &text[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let mut item_start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    ',' if depth == 1 => item_start = true,
                    c if item_start && depth == 1 && !c.is_whitespace() => {
                        item_start = false;
                        found.insert(ident(&group[i..]));
                    }
                    _ => {}
                }
            }
        } else {
            found.insert(ident(rest));
        }
    }
    found.retain(|m| modules.contains(m));
    found
}

#[test]
fn no_module_of_the_agent_library_imports_one_that_imports_it() {
    let modules = modules();
    assert!(modules.len() > 20, "{modules:?}");
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut all = Vec::new();
    files(Path::new(SRC), &mut all);
    for path in all {
        let relative = path.strip_prefix(SRC).expect("under src");
        let top = relative
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .map(|s| s.trim_end_matches(".rs").to_owned())
            .expect("a path");
        if !modules.contains(&top) {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("source");
        // Tests beside the code may reach anywhere.
        let code = text
            .split("#[cfg(test)]\nmod tests")
            .next()
            .unwrap_or(&text);
        // Comments name modules too (doc links): only code counts.
        let code: String = code
            .lines()
            .filter(|line| !line.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        let imports = imported(&code, &modules);
        edges
            .entry(top.clone())
            .or_default()
            .extend(imports.into_iter().filter(|m| *m != top));
    }
    // A depth-first walk: a module met again on the current path closes a circle.
    fn walk(
        module: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|m| m == module) {
            let mut circle = path[at..].to_vec();
            circle.push(module.to_owned());
            return Some(circle);
        }
        if !done.insert(module.to_owned()) {
            return None;
        }
        path.push(module.to_owned());
        for next in edges.get(module).into_iter().flatten() {
            if let Some(circle) = walk(next, edges, path, done) {
                return Some(circle);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    for module in edges.keys() {
        let circle = walk(module, &edges, &mut Vec::new(), &mut done);
        assert!(
            circle.is_none(),
            "an import circle: {}",
            circle.unwrap().join(" -> ")
        );
    }
}
