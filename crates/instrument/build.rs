//! Records the build's fingerprint for trace headers: the rustc version, the compile-time target
//! features and CPU, the versions of the numerics crates from Cargo.lock, and under the cuda
//! feature the cudarc version and the CUDA toolkit release (`nvcc --version`).
fn main() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = std::process::Command::new(rustc).arg("--version").output().ok().and_then(|o| String::from_utf8(o.stdout).ok()).map(|s| s.trim().to_string()).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=CANDLE_TRACE_RUSTC={version}");
    println!("cargo:rerun-if-env-changed=RUSTC");
    // Target features enabled at compile time (`-C target-feature`, `-C target-cpu` imply them).
    let features = std::env::var("CARGO_CFG_TARGET_FEATURE").unwrap_or_default();
    println!("cargo:rustc-env=CANDLE_TRACE_TARGET_FEATURES={features}");
    // `-C target-cpu=NAME` from the encoded flags (nothing else of RUSTFLAGS: it may hold paths).
    let flags = std::env::var("CARGO_ENCODED_RUSTFLAGS").unwrap_or_default();
    let words: Vec<&str> = flags.split('\x1f').collect();
    let mut cpu = String::new();
    for (i, w) in words.iter().enumerate() {
        let opt = if *w == "-C" { words.get(i + 1).copied().unwrap_or("") } else { w.strip_prefix("-C").unwrap_or("") };
        if let Some(c) = opt.strip_prefix("target-cpu=") {
            cpu = c.chars().filter(|c| c.is_ascii_alphanumeric() || "-_.".contains(*c)).take(32).collect();
        }
    }
    println!("cargo:rustc-env=CANDLE_TRACE_TARGET_CPU={cpu}");
    println!("cargo:rerun-if-env-changed=CARGO_ENCODED_RUSTFLAGS");
    println!("cargo:rerun-if-env-changed=CUDA_PATH");
    // Versions of the crates whose kernels decide the numbers, as this build resolved them.
    const NUMERICS: [&str; 10] = ["candle-core", "candle-nn", "candle-transformers", "gemm", "gemm-common", "gemm-f16", "gemm-f32", "half", "rayon", "tokenizers"];
    // The Cargo.lock of the build that compiles this crate: the workspace whose target folder
    // holds OUT_DIR (a binary that uses this crate as a library records its own versions), else
    // the one above this crate's folder. None found: no versions (a trace then compares them as
    // unknown).
    let lock = ["OUT_DIR", "CARGO_MANIFEST_DIR"]
        .iter()
        .filter_map(std::env::var_os)
        .flat_map(|d| std::path::PathBuf::from(d).ancestors().map(|a| a.join("Cargo.lock")).collect::<Vec<_>>())
        .find(|l| l.is_file());
    if let Some(lock) = &lock {
        println!("cargo:rerun-if-changed={}", lock.display());
    }
    let text = lock.and_then(|l| std::fs::read_to_string(l).ok()).unwrap_or_default();
    let mut found: Vec<String> = Vec::new();
    let mut name = String::new();
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("name = ") {
            name = n.trim_matches('"').to_string();
        } else if let Some(v) = line.strip_prefix("version = ") {
            if NUMERICS.contains(&name.as_str()) {
                found.push(format!("{name}={}", v.trim_matches('"')));
            }
        }
    }
    // Under the cuda feature: the cudarc bindings candle drives the GPU with, and the CUDA toolkit
    // they were generated for (cudarc's `cuda-version-from-build-system` reads it from nvcc).
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        let mut name = String::new();
        for line in text.lines() {
            if let Some(n) = line.strip_prefix("name = ") {
                name = n.trim_matches('"').to_string();
            } else if let (Some(v), "cudarc") = (line.strip_prefix("version = "), name.as_str()) {
                found.push(format!("cudarc={}", v.trim_matches('"')));
            }
        }
        let nvcc = std::process::Command::new("nvcc").arg("--version").output().ok().and_then(|o| String::from_utf8(o.stdout).ok()).unwrap_or_default();
        // "Cuda compilation tools, release 12.4, V12.4.131": keep the digits and dots after "release ".
        let release: String = nvcc.split("release ").nth(1).unwrap_or("").chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
        if !release.is_empty() {
            found.push(format!("cuda-toolkit={release}"));
        }
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        compile_digest_ptx();
    }
    found.sort();
    found.dedup();
    println!("cargo:rustc-env=CANDLE_TRACE_CRATES={}", found.join(","));
}

/// Under the cuda feature: compiles the device digest kernels (`kernels/digest.cu`) to PTX in
/// OUT_DIR for `crate::digest::device::cuda`. The PTX targets `CUDA_COMPUTE_CAP` (as candle's
/// kernels do; default 80), which the driver JIT-compiles for newer GPUs.
fn compile_digest_ptx() {
    println!("cargo:rerun-if-changed=kernels/digest.cu");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("digest.ptx");
    let cap: String = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into()).chars().filter(char::is_ascii_digit).collect();
    let status = std::process::Command::new("nvcc").args(["-ptx", "-O3", "-std=c++17", &format!("-arch=compute_{cap}"), "kernels/digest.cu", "-o"]).arg(&out).status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("nvcc failed on kernels/digest.cu ({s}); the cuda feature needs the CUDA toolkit (docs/gpu.md)"),
        Err(e) => panic!("cannot run nvcc ({e}); the cuda feature needs the CUDA toolkit on PATH (docs/gpu.md)"),
    }
}
