//! What differs between the builds that wrote two traces (their [`BuildInfo`] fingerprints),
//! for bisect's environment diff.

use candle_trace_format::record::BuildInfo;

/// The differences between two builds, as (key, a, b): `build.target_features` (the features
/// only one side has, `+x` / `-x` relative to a), `build.target_cpu`, `build.features`, and
/// `build.crate.NAME` per crate version that differs. A missing fingerprint (a trace older than
/// format 1.2) compares as unknown, not as different.
pub fn build_diff(a: Option<&BuildInfo>, b: Option<&BuildInfo>) -> Vec<(String, String, String)> {
    let (Some(a), Some(b)) = (a, b) else { return Vec::new() };
    let mut out = Vec::new();
    if a.target_features != b.target_features {
        let only = |x: &BuildInfo, y: &BuildInfo| -> Vec<String> { x.target_features.iter().filter(|f| !y.target_features.contains(f)).cloned().collect() };
        let (ka, kb) = (only(a, b), only(b, a));
        out.push(("build.target_features".into(), if ka.is_empty() { "-".into() } else { ka.join(" ") }, if kb.is_empty() { "-".into() } else { kb.join(" ") }));
    }
    if a.target_cpu != b.target_cpu {
        out.push(("build.target_cpu".into(), a.target_cpu.clone(), b.target_cpu.clone()));
    }
    if a.features != b.features {
        out.push(("build.features".into(), a.features.join(","), b.features.join(",")));
    }
    let names: std::collections::BTreeSet<&String> = a.crates.iter().chain(&b.crates).map(|(k, _)| k).collect();
    for n in names {
        let v = |x: &BuildInfo| x.crates.iter().find(|(k, _)| k == n).map_or("-".to_string(), |(_, v)| v.clone());
        if v(a) != v(b) {
            out.push((format!("build.crate.{n}"), v(a), v(b)));
        }
    }
    out
}
