//! The environment of a run, as stored in a trace header: versions, OS, CPU model and SIMD
//! features, thread count, and the environment variables that change numerics, from the
//! allowlist [`ENV_ALLOWLIST`]. Nothing identifying (user, host, home path) is read, and a
//! variable's value is kept only when it looks like what it should be (a number, a known word):
//! otherwise the header says the variable was set, not to what.

use candle_trace_format::record::{BuildInfo, EnvInfo};

/// candle version this build links (pinned with `=` in Cargo.toml).
pub const CANDLE_VERSION: &str = "0.11.1";

/// The most CPU threads `--threads` and [`pin_threads`] accept.
pub const MAX_THREADS: usize = 1024;

/// Pins candle's CPU kernels to `n` threads by setting `RAYON_NUM_THREADS`, which rayon's pool
/// and candle's gemm read on first use and candle reads at every kernel call
/// (`candle_core::utils::get_num_threads`): call it before any kernel runs. With
/// [`pin_candle_threads`], the one place this project sets the variable (the recorded header
/// keeps the values the user set, captured before: [`numeric_env_vars`]).
///
/// # Errors
/// [`candle_trace_format::Error::Usage`] unless `1 <= n <=` [`MAX_THREADS`].
pub fn pin_threads(n: usize) -> candle_trace_format::Result<()> {
    if !(1..=MAX_THREADS).contains(&n) {
        return Err(candle_trace_format::Error::usage(format!("--threads {n}: expected 1 to {MAX_THREADS}")));
    }
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    PINNED.store(false, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// Fixes candle's CPU thread count for this process at the value candle itself would use, when
/// the user set none (`RAYON_NUM_THREADS` unset), and returns the count in effect.
///
/// candle 0.11 asks for its thread count at every CPU matmul
/// (`candle_core::utils::get_num_threads`); with `RAYON_NUM_THREADS` unset, that call reads
/// the CPU mask and, on Linux, parses `/proc/cpuinfo` for the physical core count, every time.
/// On a 2-core VM this was 80-90% of an untraced run of the builtin model (110 ms against 20 ms
/// for the whole process, docs/performance.md "candle's thread count, read at every matmul").
/// Pinning the variable to the count candle computes once makes the matmuls take the same
/// number of threads, so the same results, without the read. rayon's global pool, which reads
/// the variable when it starts, then has that many threads too, as under `--threads N`.
///
/// Call it before any thread is started (it sets a process environment variable) and after
/// capturing the user's variables for the trace header ([`numeric_env_vars`]): the header keeps
/// what the user set, and its thread count is this one either way. A child process this one
/// starts should not inherit the variable as if the user had set it: see [`set_by_pin`].
pub fn pin_candle_threads() -> usize {
    let n = candle_core::utils::get_num_threads();
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
        PINNED.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    n
}

/// Whether `RAYON_NUM_THREADS` holds what [`pin_candle_threads`] set, not the user's value
/// (remove it from a child process's environment, which pins its own).
pub fn set_by_pin() -> bool {
    PINNED.load(std::sync::atomic::Ordering::Relaxed)
}

static PINNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// What a kept variable's value must look like.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueKind {
    /// Decimal digits (a thread count).
    Count,
    /// 0, 1, true, false, yes, no, on, off (any case).
    Flag,
    /// A short identifier or list of them: letters, digits, `_`, `.`, `:` and `,`, at most 32
    /// characters (a CPU type, an instruction set, a binding policy, as OPENBLAS_CORETYPE=Haswell,
    /// MKL_CBWR=AVX2,STRICT or OMP_PROC_BIND=spread,close).
    Word,
    /// Device or CPU ordinals: digits, commas and ranges (CUDA_VISIBLE_DEVICES=0,1,
    /// CANDLE_CPU_MASK=0-3,8).
    Ordinals,
}

/// The environment variables a trace header keeps: each changes numerics or the kernels candle
/// (or the BLAS and OpenMP libraries it may link) picks. Sorted by name.
pub const ENV_ALLOWLIST: &[(&str, ValueKind)] = &[
    ("CANDLE_BARRIER_POOL_SPIN_LIMIT", ValueKind::Count),
    ("CANDLE_CPU_AFFINITY", ValueKind::Flag),
    ("CANDLE_CPU_MASK", ValueKind::Ordinals),
    ("CANDLE_DEQUANTIZE_ALL", ValueKind::Flag),
    ("CANDLE_DEQUANTIZE_ALL_F16", ValueKind::Flag),
    ("CANDLE_NUM_THREADS", ValueKind::Count),
    ("CUBLAS_WORKSPACE_CONFIG", ValueKind::Word),
    ("CUDA_VISIBLE_DEVICES", ValueKind::Ordinals),
    ("MKL_CBWR", ValueKind::Word),
    ("MKL_DYNAMIC", ValueKind::Flag),
    ("MKL_ENABLE_INSTRUCTIONS", ValueKind::Word),
    ("MKL_NUM_THREADS", ValueKind::Count),
    ("MKL_THREADING_LAYER", ValueKind::Word),
    ("NVIDIA_TF32_OVERRIDE", ValueKind::Flag),
    ("OMP_DYNAMIC", ValueKind::Flag),
    ("OMP_NUM_THREADS", ValueKind::Count),
    ("OMP_PLACES", ValueKind::Word),
    ("OMP_PROC_BIND", ValueKind::Word),
    ("OMP_WAIT_POLICY", ValueKind::Word),
    ("OPENBLAS_CORETYPE", ValueKind::Word),
    ("OPENBLAS_NUM_THREADS", ValueKind::Count),
    ("RAYON_NUM_THREADS", ValueKind::Count),
];

/// True when `v` looks like a value of `kind`.
pub fn value_fits(kind: ValueKind, v: &str) -> bool {
    let short = !v.is_empty() && v.len() <= 32;
    short
        && match kind {
            ValueKind::Count => v.bytes().all(|b| b.is_ascii_digit()),
            ValueKind::Flag => {
                matches!(v.to_ascii_lowercase().as_str(), "0" | "1" | "true" | "false" | "yes" | "no" | "on" | "off")
            }
            ValueKind::Word => v.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b',')),
            ValueKind::Ordinals => v.bytes().all(|b| b.is_ascii_digit() || b == b',' || b == b'-'),
        }
}

/// The value a header stores for a variable set to something that does not fit its kind.
pub const UNFIT_VALUE: &str = "(set; value not recorded)";

/// The allowlisted environment variables of `vars` that are set, as (name, value) sorted by
/// name; a value that does not fit its kind is replaced by [`UNFIT_VALUE`].
pub fn filter_env_vars(vars: impl IntoIterator<Item = (String, String)>) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = vars
        .into_iter()
        .filter_map(|(k, v)| {
            let (_, kind) = ENV_ALLOWLIST.iter().find(|(name, _)| *name == k)?;
            let v = if value_fits(*kind, &v) { v } else { UNFIT_VALUE.to_string() };
            Some((k, v))
        })
        .collect();
    out.sort();
    out
}

/// The process's environment variables that change numerics ([`filter_env_vars`]).
pub fn numeric_env_vars() -> Vec<(String, String)> {
    filter_env_vars(std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().unwrap_or_default()))))
}

/// The CPU's model name, then its data caches: `AMD EPYC (L1d 32K 8-way, L2 1024K 8-way, L3
/// 32768K 16-way)`. The caches belong here because the gemm crate under candle's CPU matmuls
/// sizes its blocks by them (read from the same sysfs files), and so sums in another order on
/// a machine with other caches: measured here, a 48 KiB L1d in place of 32 KiB changes a padded
/// MiniLM batch's embedding in its last bits, the CPU's name and extensions the same (virtual
/// machines of one name report different caches).
fn cpu_model() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name") || l.starts_with("Model") || l.starts_with("cpu model")).and_then(|l| l.split_once(':')).map(|(_, v)| v.trim().to_string()))
        .unwrap_or_else(|| "unknown".into());
    match data_caches() {
        Some(c) => format!("{model} ({c})"),
        None => model,
    }
}

/// CPU 0's data and unified caches as Linux's sysfs gives them (`/sys/devices/system/cpu/cpu0/
/// cache/index*`: level, type, size, ways), lowest level first; `None` where it says nothing.
fn data_caches() -> Option<String> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    let read = |p: &std::path::Path, name: &str| std::fs::read_to_string(p.join(name)).map(|s| s.trim().to_string()).unwrap_or_default();
    let mut levels: Vec<(String, String)> = dir
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("index")))
        .filter_map(|p| {
            let (level, kind) = (read(&p, "level"), read(&p, "type"));
            let name = match kind.as_str() {
                "Data" => format!("L{level}d"),
                "Unified" => format!("L{level}"),
                _ => return None,
            };
            // What sysfs leaves out is left out (no size: not listed).
            let (size, ways) = (read(&p, "size"), read(&p, "ways_of_associativity"));
            (!size.is_empty()).then(|| (level, if ways.is_empty() { format!("{name} {size}") } else { format!("{name} {size} {ways}-way") }))
        })
        .collect();
    levels.sort();
    (!levels.is_empty()).then(|| levels.into_iter().map(|(_, s)| s).collect::<Vec<_>>().join(", "))
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
    let pretty = std::fs::read_to_string("/etc/os-release").ok().and_then(|s| s.lines().find_map(|l| l.strip_prefix("PRETTY_NAME=").map(|v| v.trim_matches('"').to_string())));
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok().map(|s| s.trim().to_string());
    match (pretty, kernel) {
        (Some(p), Some(k)) => format!("{} ({p}, kernel {k})", std::env::consts::OS),
        (Some(p), None) => format!("{} ({p})", std::env::consts::OS),
        _ => std::env::consts::OS.to_string(),
    }
}

/// Captures the environment. `env_vars` are the numerics-relevant variables as the user set them
/// (captured before the CLI applies `--threads`), less `RAYON_NUM_THREADS`: `threads`, the
/// thread count in effect, is what it decided, and `--threads` overrides it (a run on 2
/// threads was stored as `RAYON_NUM_THREADS=1`, and two runs on 1 thread differed by the
/// variable: a fresh-user trial).
pub fn capture(mut env_vars: Vec<(String, String)>, threads: usize, device: &str) -> EnvInfo {
    env_vars.retain(|(k, _)| k != "RAYON_NUM_THREADS");
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

/// This build's fingerprint (see [`BuildInfo`]), from what `build.rs` recorded.
pub fn build_info() -> BuildInfo {
    let list = |s: &str| -> Vec<String> {
        let mut v: Vec<String> = s.split(',').filter(|x| !x.is_empty()).map(String::from).collect();
        v.sort();
        v
    };
    let features = [("cuda", cfg!(feature = "cuda")), ("metal", cfg!(feature = "metal"))].iter().filter(|x| x.1).map(|x| x.0.to_string()).collect();
    BuildInfo {
        target_features: list(env!("CANDLE_TRACE_TARGET_FEATURES")),
        target_cpu: env!("CANDLE_TRACE_TARGET_CPU").into(),
        features,
        crates: list(env!("CANDLE_TRACE_CRATES")).into_iter().filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string()))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_trace_compare::build_diff::build_diff;

    /// Where Linux lists CPU 0's caches, the CPU string names each data or unified level, with
    /// the size and ways sysfs gives (what gemm blocks its matmuls by).
    #[test]
    fn the_cpu_names_its_data_caches() {
        let index0 = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache/index0");
        if !index0.join("size").exists() {
            eprintln!("skipped: this machine's sysfs lists no caches");
            return;
        }
        let size = std::fs::read_to_string(index0.join("size")).unwrap();
        let level = std::fs::read_to_string(index0.join("level")).unwrap();
        let cpu = cpu_model();
        assert!(cpu.contains(&format!("(L{}", level.trim())) && cpu.contains(&format!(" {} ", size.trim())) && cpu.ends_with("-way)"), "{cpu}");
        assert!(!cpu.contains("Instruction"), "{cpu}");
    }

    #[test]
    fn build_fingerprints_diff_by_feature_cpu_and_crate() {
        let here = build_info();
        assert!(here.crates.iter().any(|(k, v)| k == "candle-core" && v == CANDLE_VERSION), "{here:?}");
        assert!(build_diff(Some(&here), Some(&here)).is_empty());
        let mut other = here.clone();
        other.target_features.retain(|f| f != "avx2");
        other.target_features.push("zz-extra".into());
        other.target_cpu = "x86-64-v2".into();
        other.crates.iter_mut().filter(|(k, _)| k == "gemm").for_each(|(_, v)| *v = "0.0.1".into());
        let d = build_diff(Some(&here), Some(&other));
        let keys: Vec<&str> = d.iter().map(|x| x.0.as_str()).collect();
        assert!(keys.contains(&"build.target_features") && keys.contains(&"build.target_cpu"), "{d:?}");
        let tf = d.iter().find(|x| x.0 == "build.target_features").unwrap();
        assert_eq!(tf.2, "zz-extra");
        if here.target_features.iter().any(|f| f == "avx2") {
            assert_eq!(tf.1, "avx2", "{d:?}");
        }
        if here.crates.iter().any(|(k, _)| k == "gemm") {
            assert!(keys.contains(&"build.crate.gemm"), "{d:?}");
        }
        assert!(build_diff(None, Some(&here)).is_empty(), "an old trace has no fingerprint: unknown, not different");
    }

    #[test]
    fn only_allowlisted_fitting_values_are_kept() {
        let vars = [
            ("RAYON_NUM_THREADS", "4"),
            ("OMP_NUM_THREADS", "/home/alice"),
            ("CANDLE_SECRET_TOKEN", "abc"),
            ("HOME", "/home/alice"),
            ("CANDLE_DEQUANTIZE_ALL", "1"),
            ("OPENBLAS_CORETYPE", "Haswell"),
            ("OMP_PROC_BIND", "spread,close"),
            ("MKL_THREADING_LAYER", "GNU"),
            ("OMP_PLACES", "{0:4}"),
        ];
        let got = filter_env_vars(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let want: Vec<(String, String)> = [
            ("CANDLE_DEQUANTIZE_ALL", "1"),
            ("MKL_THREADING_LAYER", "GNU"),
            ("OMP_NUM_THREADS", UNFIT_VALUE),
            ("OMP_PLACES", UNFIT_VALUE),
            ("OMP_PROC_BIND", "spread,close"),
            ("OPENBLAS_CORETYPE", "Haswell"),
            ("RAYON_NUM_THREADS", "4"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(got, want);
        assert!(ENV_ALLOWLIST.windows(2).all(|w| w[0].0 < w[1].0), "allowlist sorted");
    }
}
