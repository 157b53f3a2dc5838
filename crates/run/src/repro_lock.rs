//! The `Cargo.lock` of a candle-only repro project ([`crate::candle_repro`]): the versions this
//! build of candle-trace was compiled with, so the repro links the same candle, gemm and half
//! that made the recording, not the newest ones a fresh resolve would pick (a gemm release can
//! change a kernel's bits).
//!
//! It is cut from this workspace's own `Cargo.lock` (compiled in): the packages reachable from
//! `candle-core` and `candle-nn`, plus the repro's own package. Cargo drops entries the repro
//! does not use and adds what is missing. Lockfile layout: <https://doc.rust-lang.org/cargo/guide/cargo-toml-vs-cargo-lock.html>
//! (a `version` key and `[[package]]` tables with `name`, `version`, `source`, `checksum`,
//! `dependencies` given as `"name"` or `"name version"`).

use std::collections::{BTreeMap, BTreeSet};

/// A package in a lockfile: (name, version).
type Key = (String, String);

/// This workspace's lockfile, as it was when this binary was built.
const WORKSPACE_LOCK: &str = include_str!("../../../Cargo.lock");

/// The repro's lockfile for candle `candle` (the recording's version), `None` when this build
/// links another candle version (the repro then resolves afresh) or the compiled-in lockfile
/// cannot be read.
pub fn lockfile(candle: &str) -> Option<String> {
    let lock: toml::Table = WORKSPACE_LOCK.parse().ok()?;
    let packages: Vec<&toml::Table> = lock.get("package")?.as_array()?.iter().filter_map(toml::Value::as_table).collect();
    let key = |p: &toml::Table| -> Option<Key> { Some((p.get("name")?.as_str()?.to_string(), p.get("version")?.as_str()?.to_string())) };
    let by_key: BTreeMap<Key, &toml::Table> = packages.iter().filter_map(|p| Some((key(p)?, *p))).collect();
    let versions = |name: &str| -> Vec<String> { by_key.keys().filter(|(n, _)| n == name).map(|(_, v)| v.clone()).collect() };
    let roots = ["candle-core", "candle-nn"].map(|n| (n.to_string(), candle.to_string()));
    if !roots.iter().all(|r| by_key.contains_key(r)) {
        return None;
    }
    // Reachable packages, each dependency entry "name" (one version in the lock) or "name version".
    let (mut seen, mut todo): (BTreeSet<Key>, Vec<Key>) = (BTreeSet::new(), roots.to_vec());
    while let Some(k) = todo.pop() {
        if !seen.insert(k.clone()) {
            continue;
        }
        let deps = by_key.get(&k).and_then(|p| p.get("dependencies")).and_then(toml::Value::as_array).cloned().unwrap_or_default();
        for d in deps.iter().filter_map(toml::Value::as_str) {
            let mut it = d.split(' ');
            let name = it.next().unwrap_or_default();
            let version = it.next().map(str::to_string).or_else(|| versions(name).into_iter().next());
            if let Some(v) = version {
                todo.push((name.to_string(), v));
            }
        }
    }
    let mut out = toml::Table::new();
    out.insert("version".into(), lock.get("version").cloned().unwrap_or(toml::Value::Integer(4)));
    let mut own = toml::Table::new();
    own.insert("name".into(), "candle-repro".into());
    own.insert("version".into(), "0.1.0".into());
    own.insert("dependencies".into(), toml::Value::Array(vec!["candle-core".into(), "candle-nn".into()]));
    let mut list = vec![toml::Value::Table(own)];
    list.extend(seen.iter().filter_map(|k| by_key.get(k)).map(|p| toml::Value::Table((*p).clone())));
    out.insert("package".into(), toml::Value::Array(list));
    Some(format!("# Cut by candle-trace from the lockfile of the build that wrote this repro.\n{}", toml::to_string(&out).ok()?))
}

#[cfg(test)]
mod tests {
    /// This build's candle: the lockfile pins it and its gemm, and nothing of candle-trace.
    #[test]
    fn pins_the_linked_candle_and_its_kernels() {
        let lock = super::lockfile("0.11.1").expect("this workspace links candle 0.11.1");
        let t: toml::Table = lock.parse().unwrap();
        let names: Vec<(&str, &str)> = t["package"].as_array().unwrap().iter().map(|p| (p["name"].as_str().unwrap(), p["version"].as_str().unwrap())).collect();
        assert!(names.contains(&("candle-core", "0.11.1")) && names.iter().any(|(n, _)| *n == "gemm") && names.iter().any(|(n, _)| *n == "half"), "{names:?}");
        assert!(!names.iter().any(|(n, _)| n.starts_with("candle-trace") || *n == "candle-transformers"), "{names:?}");
        assert!(super::lockfile("0.0.1").is_none());
    }
}
