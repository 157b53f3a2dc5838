//! Which kind of setting two runs differ in, from the header keys that differ, and the remedy
//! that names those keys. A root whose operands had the same shapes, dtypes and thread counts
//! is classed by the first kind present, most specific first: the model (its file or a config
//! key), a run setting (`--numerics`, the sampler), the build (target features, crate versions,
//! toolchain), the machine's environment (CPU, OS, device, numerics variables); none: run to run.

use super::{CauseClass, EnvDiff};
use crate::untrusted::Untrusted;

/// The kind of a differing header key (as [`super::env_diff`] and
/// [`crate::build_diff::build_diff`] name them), or `None` for keys that do not change what an
/// op computes (the prompt, which ops were dumped, `--max-tokens`, the model's file name, the
/// record level `run.level`).
pub fn key_class(key: &str) -> Option<CauseClass> {
    let k = key;
    if k == "run.model.config.numerics" {
        return Some(CauseClass::SettingDiffers);
    }
    // `run.perturb` is a setting that changes what ops compute: a root at the perturbed op itself
    // is classed by its record (`CauseClass::Perturbed`); one downstream of a perturbed op the
    // trace does not record (`--level layers`) by this key.
    if k == "run.model.name" || k.starts_with("run.prompt") || k.starts_with("run.texts") || k == "run.requests" || matches!(k, "run.max_tokens" | "run.dump" | "run.level") {
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

/// Whether header key `key` is one that class `class` is about: its kind ([`key_class`]), or
/// for the classes read from the operands, the settings behind them (`run.dtype`; the thread
/// counts; the prefill chunk, batch and requests).
fn concerns(class: CauseClass, key: &str) -> bool {
    match class {
        CauseClass::DtypeDiffers => key == "run.dtype",
        CauseClass::ThreadsDiffer => matches!(key, "run.threads" | "env.threads"),
        CauseClass::ShapesDiffer => matches!(key, "run.prefill_chunk" | "run.batch" | "run.requests"),
        CauseClass::SettingDiffers => key_class(key) == Some(class) && key != "run.dtype",
        _ => key_class(key) == Some(class),
    }
}

/// A header value as a reader wants it: a JSON string's text without its quotes (config values
/// are stored as JSON text, so `"\"upstream\""` is `upstream`), `unset` for a key one run lacks.
fn shown(v: &str) -> String {
    let mut v = v.to_string();
    for _ in 0..2 {
        match serde_json::from_str::<String>(&v) {
            Ok(s) => v = s,
            Err(_) => break,
        }
    }
    if v == "null" || v == "-" {
        "unset".into()
    } else {
        v
    }
}

/// The remedy for `class`: [`CauseClass::remedy`], then the keys behind it that differ with both
/// values ("…: run.model.config.rope_theta (a 10000.0, b 500000.0)"). It holds strings from the
/// traces: escape it where it goes.
///
/// When both runs recorded `--numerics invariant` and the class is a shape difference, the
/// batch-invariant kernels should have made the shapes irrelevant: the remedy says the mode has
/// a defect at this op, to report, instead of pointing to the mode.
pub fn remedy(class: CauseClass, env: &[EnvDiff], both_invariant: bool) -> Untrusted {
    let keys: Vec<String> = env.iter().filter(|e| concerns(class, &e.key)).take(6).map(|e| format!("{} (a {}, b {})", e.key.unescaped(), shown(e.a.unescaped()), shown(e.b.unescaped()))).collect();
    let text = if both_invariant && class == CauseClass::ShapesDiffer { INVARIANT_DEFECT } else { class.remedy() };
    if keys.is_empty() {
        return text.into();
    }
    format!("{text}: {}", keys.join("; ")).into()
}

/// The remedy of a shape difference between two runs that both ran `--numerics invariant`.
pub const INVARIANT_DEFECT: &str = "a defect of --numerics invariant: both runs ran the batch-invariant kernels, yet this op's output changed with its operand shapes; please report it with both traces (`trace bundle`), naming the knob that differs";

/// Whether a trace header's run recorded `--numerics invariant` (its model config's `numerics`).
pub fn invariant(h: &candle_trace_format::record::Header) -> bool {
    h.run.model.config.iter().any(|(k, v)| k == "numerics" && shown(v) == "invariant")
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
        assert_eq!(
            class_of(&[d("run.max_tokens", "8", "16"), d("run.model.name", "x.gguf", "y.gguf"), d("run.dump", "none", "all"), d("run.level", "ops", "layers")]),
            CauseClass::RunToRun,
            "keys that change no op: run to run"
        );
        assert_eq!(class_of(&[]), CauseClass::RunToRun);
        // A perturbation the trace does not show at its op (an unrecorded op, `--level layers`).
        let perturb = d("run.perturb", "null", "\"layers.1.mlp.up_proj@3\"");
        assert_eq!(class_of(std::slice::from_ref(&perturb)), CauseClass::SettingDiffers);
        assert!(remedy(CauseClass::SettingDiffers, &[perturb], false).contains("run.perturb (a unset, b layers.1.mlp.up_proj@3)"));
        assert_eq!(class_of(&[cpu.clone(), features.clone(), config.clone()]), CauseClass::ModelDiffers);
        // The remedy names the keys of its class with both values, and only those.
        let r = remedy(CauseClass::BuildDiffers, &[cpu, features], false);
        assert!(r.contains("build.target_features (a avx2 fma, b avx2)") && !r.contains("env.cpu"), "{}", r.text());
        // Two build fingerprints differing only in target features, through the build diff.
        let fp = |f: &[&str]| candle_trace_format::record::BuildInfo { target_features: f.iter().map(|x| x.to_string()).collect(), ..Default::default() };
        let diff: Vec<EnvDiff> = crate::build_diff::build_diff(Some(&fp(&["avx2", "fma"])), Some(&fp(&["avx2"]))).into_iter().map(|(k, a, b)| d(&k, &a, &b)).collect();
        assert_eq!(class_of(&diff), CauseClass::BuildDiffers, "{diff:?}");
        // Quoted JSON values lose their quotes; a key one run lacks is unset.
        let r = remedy(CauseClass::SettingDiffers, &[d("run.model.config.numerics", "null", "\"\\\"upstream\\\"\"")], false);
        assert!(r.contains("run.model.config.numerics (a unset, b upstream)"), "{}", r.text());
        assert!(remedy(CauseClass::DtypeDiffers, &[d("run.dtype", "\"q\"", "\"f32\"")], false).contains("run.dtype (a q, b f32)"));
        assert!(remedy(CauseClass::ModelDiffers, &[config], false).contains("rope_theta (a 10000, b 100000)"));
        // A shape difference points to the invariant numerics, unless both runs used them: then
        // it is the mode's defect, and the knob that differs is named.
        let chunk = d("run.prefill_chunk", "0", "1");
        let r = remedy(CauseClass::ShapesDiffer, std::slice::from_ref(&chunk), false);
        assert!(r.contains("record with --numerics invariant") && !r.contains("defect"), "{}", r.text());
        let r = remedy(CauseClass::ShapesDiffer, &[chunk], true);
        assert!(r.text().starts_with("a defect of --numerics invariant") && r.contains("run.prefill_chunk (a 0, b 1)"), "{}", r.text());
        assert_eq!(remedy(CauseClass::DtypeDiffers, &[], true).text(), CauseClass::DtypeDiffers.remedy(), "other classes keep theirs");
        let mut h = candle_trace_format::record::Header::default();
        assert!(!invariant(&h));
        h.run.model.config.push(("numerics".into(), "\"invariant\"".into()));
        assert!(invariant(&h));
    }
}
