//! The layout stays readable: no two modules of `src/` import each other, directly or around a
//! cycle (doc comments aside), so each module can be read after the ones it uses.

use std::collections::{BTreeMap, BTreeSet};

/// Module name → the crate modules its code (not its comments) names as `crate::NAME`.
fn imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let mut deps = BTreeSet::new();
        for line in std::fs::read_to_string(&path).unwrap().lines() {
            let l = line.trim_start();
            if l.starts_with("//") {
                continue;
            }
            for (i, _) in l.match_indices("crate::") {
                let rest = &l[i + "crate::".len()..];
                let m: String = rest.chars().take_while(|c| c.is_ascii_lowercase() || *c == '_').collect();
                if !m.is_empty() && m != name {
                    deps.insert(m);
                }
            }
        }
        out.insert(name, deps);
    }
    out
}

#[test]
fn no_import_cycles_between_modules() {
    let g = imports();
    assert!(g.len() > 20 && g["bisect"].contains("site"), "parsed the modules: {g:?}");
    // Depth-first search for a path from each module back to itself.
    for start in g.keys() {
        let mut stack: Vec<Vec<&String>> = vec![vec![start]];
        while let Some(path) = stack.pop() {
            let last = *path.last().unwrap();
            for d in g.get(last).into_iter().flatten() {
                assert!(d != start || path.len() < 2, "import cycle: {}", path.iter().map(|s| s.as_str()).chain([start.as_str()]).collect::<Vec<_>>().join(" -> "));
                if d != start && !path.contains(&d) && g.contains_key(d) {
                    let mut p = path.clone();
                    p.push(d);
                    stack.push(p);
                }
            }
        }
    }
}

/// Every function in `src/` fits on a screen or two: at most 120 lines, signature to closing
/// brace (a function ends at the first `}` line at its own indentation, as rustfmt writes it).
#[test]
fn no_function_over_120_lines() {
    let mut files = vec![std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
    let mut long = Vec::new();
    let mut seen = 0;
    while let Some(path) = files.pop() {
        if path.is_dir() {
            files.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            let l = lines[i];
            let body = l.trim_start();
            let indent = &l[..l.len() - body.len()];
            let is_fn = ["fn ", "pub fn ", "pub(crate) fn ", "const fn ", "pub const fn "].iter().any(|p| body.starts_with(p));
            if is_fn && !body.ends_with(';') && !body.ends_with('}') {
                let close = format!("{indent}}}");
                let end = (i + 1..lines.len()).find(|&j| lines[j] == close).unwrap_or(i);
                seen += 1;
                if end + 1 - i > 120 {
                    long.push(format!("{}:{} ({} lines)", path.display(), i + 1, end + 1 - i));
                }
                i = end;
            }
            i += 1;
        }
    }
    assert!(seen > 300, "found the functions ({seen})");
    assert!(long.is_empty(), "functions over 120 lines: {long:?}");
}
