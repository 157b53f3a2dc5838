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
