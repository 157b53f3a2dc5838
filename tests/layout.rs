//! The layout stays readable: the crates' dependencies point one way (format <- compare <-
//! instrument <- models <- run <- the CLI; kernels <- instrument), the crates that read traces never name candle, no two modules of one crate import
//! each other, directly or around a cycle (doc comments aside), so each module can be read after
//! the ones it uses.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The library crates under `crates/`, in dependency order: (folder, package name).
const CRATES: [(&str, &str); 6] = [
    ("kernels", "candle-trace-kernels"),
    ("format", "candle-trace-format"),
    ("compare", "candle-trace-compare"),
    ("instrument", "candle-trace-instrument"),
    ("models", "candle-trace-models"),
    ("run", "candle-trace-run"),
];

/// The `.rs` files under `dir`, recursively.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(p) = todo.pop() {
        if p.is_dir() {
            todo.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
    out
}

/// The code of a file without its comment lines.
fn code(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap().lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

/// The package names in the `[dependencies]` table of `crates/<dir>/Cargo.toml`.
fn dependencies(dir: &str) -> BTreeSet<String> {
    let text = std::fs::read_to_string(root().join("crates").join(dir).join("Cargo.toml")).unwrap();
    let mut deps = BTreeSet::new();
    let mut inside = false;
    for line in text.lines() {
        if line.starts_with('[') {
            inside = line.trim() == "[dependencies]";
        } else if inside {
            if let Some(name) = line.split(['=', '.']).next().map(str::trim).filter(|n| !n.is_empty() && !n.starts_with('#')) {
                deps.insert(name.to_string());
            }
        }
    }
    deps
}

/// The arrows point one way: the kernels and the format depend on no other crate of ours, the
/// comparison on the format alone, the instrumentation on those three, the models on the
/// instrumentation, the format and the comparison (not the kernels), the run crate on the models
/// and those three; none on the CLI. The models name nothing of the run crate and depend on none of its own libraries (the sampler's RNG,
/// the bundle's zip, the progress bar, the repro's TOML). Cargo refuses a cycle between
/// crates; this pins the direction. The format and the comparison never run a tensor op: their
/// code names no candle crate, except the format's error type, whose candle variant exists only
/// under its `candle` feature (which the crates that run tensor ops turn on).
#[test]
fn crates_depend_one_way_and_readers_name_no_candle() {
    let ours = |d: &BTreeSet<String>| -> BTreeSet<String> { d.iter().filter(|n| n.starts_with("candle-trace")).cloned().collect() };
    let set = |v: &[&str]| -> BTreeSet<String> { v.iter().map(|s| s.to_string()).collect() };
    assert_eq!(ours(&dependencies("kernels")), set(&[]));
    assert_eq!(ours(&dependencies("format")), set(&[]));
    assert_eq!(ours(&dependencies("compare")), set(&["candle-trace-format"]));
    assert_eq!(ours(&dependencies("instrument")), set(&["candle-trace-format", "candle-trace-compare", "candle-trace-kernels"]));
    assert_eq!(ours(&dependencies("models")), set(&["candle-trace-format", "candle-trace-compare", "candle-trace-instrument"]));
    assert_eq!(ours(&dependencies("run")), set(&["candle-trace-format", "candle-trace-compare", "candle-trace-instrument", "candle-trace-models"]));
    for name in ["rand", "zip", "indicatif", "toml"] {
        assert!(!dependencies("models").contains(name), "crates/models/Cargo.toml depends on {name}");
    }
    let models = rust_files(&root().join("crates/models/src"));
    assert!(models.len() >= 10, "{models:?}");
    for f in models {
        assert!(!code(&f).contains("candle_trace_run"), "{} names the run crate", f.display());
    }
    assert!(!dependencies("compare").iter().any(|d| d.starts_with("candle-") && !d.starts_with("candle-trace")), "{:?}", dependencies("compare"));
    assert!(dependencies("run").contains("candle-core"));
    for (dir, forbidden) in
        [("format", &["candle_trace_compare", "candle_trace_run", "candle_nn", "candle_transformers"][..]), ("compare", &["candle_trace_run", "candle_core", "candle_nn", "candle_transformers"][..])]
    {
        let files = rust_files(&root().join("crates").join(dir).join("src"));
        assert!(files.len() >= 10, "{dir}: {files:?}");
        for f in files {
            let c = code(&f);
            for name in forbidden {
                assert!(!c.contains(name), "{} names {name}", f.display());
            }
            if dir == "format" && !f.ends_with("error.rs") {
                assert!(!c.contains("candle_core"), "{} names candle_core", f.display());
            }
        }
    }
}

/// Each crate's manifest lists only what it uses: every package in its `[dependencies]` is named
/// in its code (`src/`, `build.rs`), as Rust spells it (`candle-core` as `candle_core`).
#[test]
fn each_crate_depends_only_on_what_its_code_names() {
    for (dir, _) in CRATES {
        let base = root().join("crates").join(dir);
        let mut files = rust_files(&base.join("src"));
        files.extend([base.join("build.rs")].into_iter().filter(|f| f.is_file()));
        let text: String = files.iter().map(|f| std::fs::read_to_string(f).unwrap()).collect::<Vec<_>>().join("\n");
        let deps = dependencies(dir);
        assert!(!deps.is_empty(), "parsed crates/{dir}/Cargo.toml");
        for dep in deps {
            let name = dep.replace('-', "_");
            let named = text.match_indices(&name).any(|(i, _)| {
                let before = text[..i].chars().next_back().is_none_or(|c| !c.is_alphanumeric() && c != '_');
                let after = text[i + name.len()..].chars().next().is_none_or(|c| !c.is_alphanumeric() && c != '_');
                before && after
            });
            assert!(named, "crates/{dir}/Cargo.toml depends on {dep}, which its code never names");
        }
    }
}

/// Module name → the modules of its own crate its code (not its comments) names as
/// `crate::NAME`, for the top-level modules (files and folders) of `src_dir`.
fn imports(src_dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(src_dir).unwrap() {
        let path = entry.unwrap().path();
        // A module is a file, or a folder of files (`bisect/mod.rs` and its children) read as one.
        let files = if path.is_dir() { rust_files(&path) } else { vec![path.clone()] };
        if files.is_empty() || (!path.is_dir() && path.extension().is_none_or(|e| e != "rs")) {
            continue;
        }
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let mut deps = BTreeSet::new();
        for l in files.iter().map(|f| code(f)).collect::<Vec<_>>().join("\n").lines() {
            for (i, _) in l.match_indices("crate::") {
                if l[..i].ends_with('_') {
                    continue; // candle_trace_format::... names another crate
                }
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
    for (dir, _) in CRATES {
        let g = imports(&root().join("crates").join(dir).join("src"));
        assert!(g.len() >= if dir == "kernels" { 2 } else { 10 }, "parsed the modules of {dir}: {g:?}");
        // Depth-first search for a path from each module back to itself.
        for start in g.keys() {
            let mut stack: Vec<Vec<&String>> = vec![vec![start]];
            while let Some(path) = stack.pop() {
                let last = *path.last().unwrap();
                for d in g.get(last).into_iter().flatten() {
                    assert!(d != start || path.len() < 2, "import cycle in {dir}: {}", path.iter().map(|s| s.as_str()).chain([start.as_str()]).collect::<Vec<_>>().join(" -> "));
                    if d != start && !path.contains(&d) && g.contains_key(d) {
                        let mut p = path.clone();
                        p.push(d);
                        stack.push(p);
                    }
                }
            }
        }
    }
    let compare = imports(&root().join("crates/compare/src"));
    assert!(compare["bisect"].contains("align"), "{compare:?}");
}

/// (file, first line, lines) of every function in `files`, signature to closing brace (a function
/// ends at the first `}` line at its own indentation, as rustfmt writes it).
fn functions(files: &[PathBuf]) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            let l = lines[i];
            let body = l.trim_start();
            let indent = &l[..l.len() - body.len()];
            let body = ["pub(crate) ", "pub(super) ", "pub "].iter().find_map(|p| body.strip_prefix(p)).unwrap_or(body);
            let is_fn = body.starts_with("fn ") || body.starts_with("const fn ");
            if is_fn && !body.ends_with(';') && !body.ends_with('}') {
                let close = format!("{indent}}}");
                let end = (i + 1..lines.len()).find(|&j| lines[j] == close).unwrap_or(i);
                out.push((path.display().to_string(), i + 1, end + 1 - i));
                i = end;
            }
            i += 1;
        }
    }
    out
}

/// Each function fits on a screen: at most 80 lines, the CLI's (`src/`) too; each file at most
/// 800 lines; the CLI's `main.rs` (parsing, dispatch, exit codes) under 400, its flags in
/// `src/cli/` apart from what the subcommands do in `src/commands/`.
#[test]
fn functions_and_files_fit_a_screen() {
    // The crates' own code (`src/`), not their test fixtures.
    let libs: Vec<_> = rust_files(&root().join("crates")).into_iter().filter(|f| f.components().any(|c| c.as_os_str() == "src")).collect();
    let fns = functions(&libs);
    assert!(fns.len() > 300, "found the functions ({})", fns.len());
    let long: Vec<_> = fns.iter().filter(|f| f.2 > 80).collect();
    assert!(long.is_empty(), "library functions over 80 lines: {long:?}");
    let cli_files = rust_files(&root().join("src"));
    let cli: Vec<_> = functions(&cli_files).into_iter().filter(|f| f.2 > 80).collect();
    assert!(cli.is_empty(), "CLI functions over 80 lines: {cli:?}");
    let main = std::fs::read_to_string(root().join("src/main.rs")).unwrap().lines().count();
    assert!(main < 400, "src/main.rs is {main} lines");
    for dir in ["src/cli", "src/commands"] {
        assert!(cli_files.iter().any(|f| f.starts_with(root().join(dir))), "{dir} holds the CLI's code");
    }
    let big: Vec<(String, usize)> = libs.iter().chain(&cli_files).map(|f| (f.display().to_string(), std::fs::read_to_string(f).unwrap().lines().count())).filter(|x| x.1 > 800).collect();
    assert!(big.is_empty(), "library files over 800 lines: {big:?}");
}

/// What a user tracing their own model depends on: the instrumentation crate names none of the
/// models' and the run's libraries (tokenizers, chat templates, the sampler's RNG, the bundle's zip,
/// the progress bar, the repro's TOML) in its manifest or code, and its dependency tree holds
/// minijinja, indicatif and toml not at all. candle-core 0.11 itself depends on tokenizers, zip
/// and rand unconditionally, so those three are in the tree through candle only: no crate of
/// ours is among their dependents.
#[test]
fn the_instrumentation_crate_needs_no_tokenizer_template_sampler_or_zip() {
    const RUN_ONLY: [&str; 6] = ["tokenizers", "minijinja", "zip", "rand", "indicatif", "toml"];
    let deps = dependencies("instrument");
    for name in RUN_ONLY {
        assert!(!deps.contains(name), "crates/instrument/Cargo.toml depends on {name}");
        for f in rust_files(&root().join("crates/instrument")) {
            let c = code(&f);
            let path = format!("{name}::");
            let named = c.match_indices(&path).any(|(i, _)| !c[..i].ends_with(|ch: char| ch.is_alphanumeric() || ch == '_'));
            assert!(!named, "{} names {name}", f.display());
        }
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let dependents = |name: &str| -> Option<Vec<String>> {
        let out = std::process::Command::new(&cargo)
            .args(["tree", "--offline", "-p", "candle-trace-instrument", "-e", "normal", "--prefix", "none", "--depth", "1", "-i", name])
            .current_dir(root())
            .output()
            .expect("cargo tree runs");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        out.status.success().then(|| text.lines().skip(1).filter_map(|l| l.split(' ').next()).map(String::from).collect())
    };
    for name in ["minijinja", "indicatif", "toml"] {
        assert_eq!(dependents(name), None, "{name} is in the instrumentation crate's tree");
    }
    for name in ["tokenizers", "zip", "rand"] {
        let by = dependents(name).unwrap_or_default();
        assert!(by.iter().all(|d| !d.starts_with("candle-trace")), "{name} is pulled in by {by:?}");
    }
    assert!(dependents("candle-core").is_some_and(|by| by.contains(&"candle-trace-instrument".to_string())), "cargo tree answered");
    // The example is a model of one's own, as a user writes it: of our crates it names the
    // instrumentation crate alone (`cargo test` builds it).
    let example = code(&root().join("crates/instrument/examples/custom_model.rs"));
    assert!(example.contains("candle_trace_instrument::tracer"), "read the example");
    for other in ["candle_trace_format", "candle_trace_compare", "candle_trace_models", "candle_trace_run", "candle_trace::"] {
        assert!(!example.contains(other), "examples/custom_model.rs names {other}");
    }
}
