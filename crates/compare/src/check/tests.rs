//! Unit tests of the check plan and its table.

use super::*;

/// The thread conditions on 1, 2 and 6 cores: each count once, "all" marked above 2.
#[test]
fn thread_conditions_on_any_core_count() {
    for (cores, want) in [(1, vec!["1", "2"]), (2, vec!["1", "2"]), (6, vec!["1", "2", "6 (all)"])] {
        let input = PlanInput { base: Settings::default(), prompt: "p".into(), requests: Vec::new(), vary: vec!["threads".into()], runs: 1, prompt_tokens: 5, dtypes: Vec::new(), threads_all: cores };
        let p = plan(&input).unwrap();
        let values: Vec<&str> = p.jobs.iter().filter(|j| j.knob == "threads").map(|j| j.value.as_str()).collect();
        assert_eq!(values, want, "{cores} cores");
    }
}

/// A job's command line comes from its settings; a trace is checked against the same
/// settings, never against an argument list read back.
#[test]
fn a_job_runs_and_is_checked_by_its_settings() {
    let base = Settings { model: Some("/m.gguf".into()), chat: true, max_tokens: 8, threads: Some(2), ..Settings::default() };
    let input = PlanInput { base, prompt: "p".into(), requests: Vec::new(), vary: vec!["prefill-chunk".into(), "padded-batch".into()], runs: 1, prompt_tokens: 10, dtypes: Vec::new(), threads_all: 2 };
    let p = plan(&input).unwrap();
    let values: Vec<(&str, &str)> = p.jobs.iter().map(|j| (j.knob.as_str(), j.value.as_str())).collect();
    assert_eq!(
        values,
        [
            ("baseline", "-"),
            ("repeat", "-"),
            ("prefill-chunk", "whole"),
            ("prefill-chunk", "1"),
            ("prefill-chunk", "7"),
            ("prefill-chunk", "4"),
            ("padded-batch", "3 requests"),
            ("padded-batch", "2 requests"),
            ("padded-batch", "5 requests")
        ]
    );
    let cmd = |i: usize| job_command(&p.jobs[i], Path::new("/c")).join(" ");
    assert_eq!(cmd(3), "record --model /m.gguf --chat --max-tokens 8 --prefill-chunk 1 --threads 2 --prompt-file /c/prompt.txt -o /c/prefill-chunk-1-1.trace");
    assert_eq!(cmd(6), "record --model /m.gguf --chat --max-tokens 8 --threads 2 --prompts-file /c/prompts.txt -o /c/padded-batch-3_requests-1.trace");
    let mut h = candle_trace_format::record::Header::default();
    (h.run.prompt, h.run.threads, h.run.batch, h.run.prefill_chunk) = ("p".into(), 2, 1, 1);
    assert_eq!(job_mismatch(&p.jobs[3], &p, &h), None);
    assert_eq!(job_mismatch(&p.jobs[2], &p, &h).as_deref(), Some("holds another run (--prefill-chunk 1, the job has 0)"));
    h.run.threads = 1;
    assert_eq!(job_mismatch(&p.jobs[3], &p, &h).as_deref(), Some("holds another run (--threads 1, the job has 2)"));
    assert_eq!(job_mismatch(&p.jobs[6], &p, &h).as_deref(), Some("holds another run (1 request in its batch)"));
    // Each companion set has its own file, and a run of another set is not this job's.
    assert!(cmd(8).ends_with("--prompts-file /c/prompts-3.txt -o /c/padded-batch-5_requests-1.trace"), "{}", cmd(8));
    h.run.texts = companion_batch(1, "p").iter().map(|t| t.to_string()).collect();
    (h.run.threads, h.run.prefill_chunk) = (2, 0);
    assert_eq!(job_mismatch(&p.jobs[7], &p, &h), None);
    assert_eq!(job_mismatch(&p.jobs[8], &p, &h).as_deref(), Some("holds another run (2 requests in its batch, the job has 5)"));
    let clash = PlanInput { base: Settings { batch: Some(2), ..Settings::default() }, vary: vec!["padded-batch".into()], runs: 1, ..PlanInput::default() };
    assert!(plan(&clash).unwrap_err().to_string().contains("the baseline also sets --batch"));
}

/// The whole-prompt condition is the baseline's own command: its runs are the repeats' traces,
/// recorded once (2 + 2 + 3 · 2 recordings for `--runs 2 --vary prefill-chunk`, not 2 + 4 · 2).
#[test]
fn the_baselines_own_setting_counts_the_repeats() {
    let input = PlanInput { base: Settings { max_tokens: 8, ..Settings::default() }, prompt: "p".into(), vary: vec!["prefill-chunk".into()], runs: 2, prompt_tokens: 10, ..PlanInput::default() };
    let p = plan(&input).unwrap();
    let whole: Vec<&str> = p.jobs.iter().filter(|j| j.value == "whole").map(|j| j.trace.as_str()).collect();
    assert_eq!(whole, ["repeat---1.trace", "repeat---2.trace"]);
    let names: Vec<&str> = p.recordings().iter().map(|j| j.trace.as_str()).collect();
    assert_eq!(
        names,
        [
            "baseline.trace",
            "repeat---1.trace",
            "repeat---2.trace",
            "prefill-chunk-1-1.trace",
            "prefill-chunk-1-2.trace",
            "prefill-chunk-7-1.trace",
            "prefill-chunk-7-2.trace",
            "prefill-chunk-4-1.trace",
            "prefill-chunk-4-2.trace"
        ]
    );
    assert_eq!(p.jobs.len(), 11, "the table still has a whole-prompt row of 2 runs");
}

/// An encoder's embedding difference is exact (recorded whole); logits' is a lower bound
/// (from samples and reductions) and says so.
#[test]
fn only_the_logits_figure_is_a_lower_bound() {
    let row = |encoder| Row {
        knob: "batch".into(),
        value: "2".into(),
        runs: 1,
        unique_outputs: 1,
        verdict: "numerics".into(),
        encoder,
        first_flip: None,
        root: None,
        class: None,
        logits_max_abs_diff: Some(0.0012),
        bisect: None,
        trace: None,
    };
    assert_eq!(super::render::diff_words(&row(true)), "0.0012");
    assert_eq!(super::render::diff_words(&row(false)), "≥ 0.0012");
}
