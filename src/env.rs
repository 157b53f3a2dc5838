//! The environment of a run, as stored in a trace header: versions, OS, CPU model and SIMD
//! features, thread count, and the environment variables that change numerics
//! (`RAYON_NUM_THREADS`, `CANDLE_*`). Nothing identifying (user, host, home path) is read.

use crate::record::EnvInfo;

/// candle version this build links (pinned with `=` in Cargo.toml).
pub const CANDLE_VERSION: &str = "0.11.1";

/// Environment variables that change numerics, as (name, value), sorted by name.
pub fn numeric_env_vars() -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k == "RAYON_NUM_THREADS" || k.starts_with("CANDLE_"))
        .collect();
    v.sort();
    v
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name") || l.starts_with("Model") || l.starts_with("cpu model"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn simd_features() -> Vec<String> {
    #[allow(unused_mut)]
    let mut out: Vec<&str> = Vec::new();
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    {
        macro_rules! probe {
            ($($f:tt),*) => { $( if std::arch::is_x86_feature_detected!($f) { out.push($f); } )* };
        }
        probe!("sse4.1", "sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512bf16", "avx512fp16");
    }
    #[cfg(target_arch = "aarch64")]
    {
        macro_rules! probe {
            ($($f:tt),*) => { $( if std::arch::is_aarch64_feature_detected!($f) { out.push($f); } )* };
        }
        probe!("neon", "fp16", "bf16", "i8mm", "sve");
    }
    out.into_iter().map(String::from).collect()
}

fn os() -> String {
    let pretty = std::fs::read_to_string("/etc/os-release").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("PRETTY_NAME=").map(|v| v.trim_matches('"').to_string()))
    });
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok().map(|s| s.trim().to_string());
    match (pretty, kernel) {
        (Some(p), Some(k)) => format!("{} ({p}, kernel {k})", std::env::consts::OS),
        (Some(p), None) => format!("{} ({p})", std::env::consts::OS),
        _ => std::env::consts::OS.to_string(),
    }
}

/// Captures the environment. `env_vars` are the numerics-relevant variables as the user set them
/// (captured before the CLI applies `--threads`); `threads` is the thread count in effect.
pub fn capture(env_vars: Vec<(String, String)>, threads: usize, device: &str) -> EnvInfo {
    EnvInfo {
        crate_version: env!("CARGO_PKG_VERSION").into(),
        candle_version: CANDLE_VERSION.into(),
        rustc: env!("CANDLE_TRACE_RUSTC").into(),
        os: os(),
        arch: std::env::consts::ARCH.into(),
        cpu: cpu_model(),
        simd: simd_features(),
        threads: threads as u32,
        device: device.into(),
        env_vars,
    }
}
