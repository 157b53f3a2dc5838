//! What both targets do with traces that the reader accepted.
use candle_trace::format::Trace;

pub fn consume(a: &Trace, b: &Trace) {
    for t in [a, b] {
        let s = candle_trace::show::summarize(t);
        let _ = candle_trace::show::text(&s);
        let _ = candle_trace::show::sites_text(&s);
        let _ = serde_json::to_string(&s);
        let _ = candle_trace::repro::plan(t, None);
        if let Some(seq) = t.items.iter().find_map(|i| match i {
            candle_trace::record::Item::Op(r) => Some(r.seq),
            _ => None,
        }) {
            let _ = candle_trace::repro::plan(t, Some(seq));
        }
        let _ = candle_trace::redact::redact(t, &candle_trace::redact::Keep::default());
    }
    if let Ok(r) = candle_trace::bisect::bisect(a, b) {
        let _ = candle_trace::report::text(&r);
        let _ = candle_trace::report::markdown(&r);
        let _ = serde_json::to_string(&r);
    }
}
