//! Which kind of setting two runs differ in, from the header keys that differ, and the remedy
//! that names those keys. A root whose operands had the same shapes, dtypes and thread counts
//! is classed by the first kind present, most specific first: the model (its file or a config
//! key), a run setting (`--numerics`, the sampler), the build (target features, crate versions,
//! toolchain), the machine's environment (CPU, OS, device, numerics variables); none: run to run.

use super::{CauseClass, EnvDiff};
use crate::untrusted::Untrusted;

/// The kind of a differing header key (as [`super::env_diff`] and
/// [`crate::build_diff::build_diff`] name them), or `None` for keys that do not change what an
/// op computes (the prompt, which ops were dumped, `--max-tokens`, the model's file name).
pub fn key_class(key: &str) -> Option<CauseClass> {
    let k = key;
    if k == "run.model.config.numerics" {
        return Some(CauseClass::SettingDiffers);
    }
    if k == "run.model.name" || k.starts_with("run.prompt") || k.starts_with("run.texts") || k == "run.requests" || matches!(k, "run.max_tokens" | "run.dump" | "run.perturb") {
        return None;
    }
    if k.starts_with("run.model.") {
        return Some(CauseClass::ModelDiffers);
    }
    if k.starts_with("run.") {
        return Some(CauseClass::SettingDiffers);
    }
    if k.starts_with("build.") || matches!(k, "env.crate_version" | "env.candle_version" | "env.rustc") {
        return Some(CauseClass::BuildDiffers);
    }
    if k.starts_with("env.") {
        return Some(CauseClass::EnvironmentDiffers);
    }
    None
}

/// The class of a root whose operands matched in shape, dtype and threads: the most specific
/// kind among the keys that differ (`env`), else run to run.
pub fn class_of(env: &[EnvDiff]) -> CauseClass {
    let order = [CauseClass::ModelDiffers, CauseClass::SettingDiffers, CauseClass::BuildDiffers, CauseClass::EnvironmentDiffers];
    let kinds: Vec<CauseClass> = env.iter().filter_map(|e| key_class(&e.key)).collect();
    order.into_iter().find(|c| kinds.contains(c)).unwrap_or(CauseClass::RunToRun)
}

/// The remedy for `class`: for a class read from the keys, the keys of that kind that differ
/// with both values ("make these the same: run.model.config.rope_theta (a 10000, b 100000)");
/// else [`CauseClass::remedy`]. It holds strings from the traces: escape it where it goes.
pub fn remedy(class: CauseClass, env: &[EnvDiff]) -> Untrusted {
    let keys: Vec<String> = env.iter().filter(|e| key_class(&e.key) == Some(class)).take(6).map(|e| format!("{} (a {}, b {})", e.key.unescaped(), e.a.unescaped(), e.b.unescaped())).collect();
    if keys.is_empty() {
        return class.remedy().into();
    }
    format!("{}: {}", class.remedy(), keys.join("; ")).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(key: &str, a: &str, b: &str) -> EnvDiff {
        EnvDiff { key: key.into(), a: a.into(), b: b.into() }
    }

    /// One case per kind, and the order when several differ.
    #[test]
    fn the_class_comes_from_the_keys_that_differ() {
        let numerics = d("run.model.config.numerics", "-", "\"upstream\"");
        let config = d("run.model.config.rope_theta", "\"10000\"", "\"100000\"");
        let features = d("build.target_features", "avx2 fma", "avx2");
        let var = d("env.env_vars.OMP_NUM_THREADS", "-", "\"1\"");
        let cpu = d("env.cpu", "Xeon", "EPYC");
        assert_eq!(class_of(std::slice::from_ref(&numerics)), CauseClass::SettingDiffers);
        assert_eq!(class_of(std::slice::from_ref(&config)), CauseClass::ModelDiffers);
        assert_eq!(class_of(std::slice::from_ref(&features)), CauseClass::BuildDiffers, "a build fingerprint differing only in target features");
        assert_eq!(class_of(std::slice::from_ref(&var)), CauseClass::EnvironmentDiffers);
        assert_eq!(class_of(std::slice::from_ref(&cpu)), CauseClass::EnvironmentDiffers);
        assert_eq!(class_of(&[d("run.max_tokens", "8", "16"), d("run.model.name", "x.gguf", "y.gguf"), d("run.dump", "none", "all")]), CauseClass::RunToRun, "keys that change no op: run to run");
        assert_eq!(class_of(&[]), CauseClass::RunToRun);
        assert_eq!(class_of(&[cpu.clone(), features.clone(), config.clone()]), CauseClass::ModelDiffers);
        // The remedy names the keys of its class with both values, and only those.
        let r = remedy(CauseClass::BuildDiffers, &[cpu, features]);
        assert!(r.contains("build.target_features (a avx2 fma, b avx2)") && !r.contains("env.cpu"), "{}", r.text());
        // Two build fingerprints differing only in target features, through the build diff.
        let fp = |f: &[&str]| candle_trace_format::record::BuildInfo { target_features: f.iter().map(|x| x.to_string()).collect(), ..Default::default() };
        let diff: Vec<EnvDiff> = crate::build_diff::build_diff(Some(&fp(&["avx2", "fma"])), Some(&fp(&["avx2"]))).into_iter().map(|(k, a, b)| d(&k, &a, &b)).collect();
        assert_eq!(class_of(&diff), CauseClass::BuildDiffers, "{diff:?}");
        assert!(remedy(CauseClass::ModelDiffers, &[config]).contains("rope_theta (a \"10000\", b \"100000\")"));
    }
}
