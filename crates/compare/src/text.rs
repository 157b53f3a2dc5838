//! Text helpers every report shares: strings from a trace made safe for a terminal, a markdown
//! cell or a shell, floats in report form, and JSON flattened to dotted keys. Pure functions; no
//! module here depends on another.

/// A float for a report: 4 decimals between 1e-3 and 1e4, else 3 significant digits in scientific form.
pub fn g(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x.abs() >= 1e-3 && x.abs() < 1e4 {
        format!("{x:.4}")
    } else {
        format!("{x:.2e}")
    }
}

/// `n` and a noun, plural unless `n` is 1: `1 thread`, `2 threads` (nouns whose plural adds
/// an s).
pub fn plural(n: impl Into<u64>, noun: &str) -> String {
    let n = n.into();
    format!("{n} {noun}{}", if n == 1 { "" } else { "s" })
}

/// A string from a trace made safe to print: control characters (ESC, newlines, …) escaped, so
/// a crafted trace cannot move the cursor, recolour the terminal or fake a report line.
pub fn clean(s: &str) -> String {
    if !s.chars().any(char::is_control) {
        return s.to_string();
    }
    s.chars().map(|c| if c.is_control() { c.escape_debug().to_string() } else { c.to_string() }).collect()
}

/// Escapes text for HTML content and attribute values.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in clean(s).chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// Text for a markdown table cell or inline span: control characters escaped, `|` and backticks
/// escaped, and `<`, `>`, `&` as entities (GitHub renders raw HTML, which could break the
/// page's `<details>` or hide text).
pub fn cell(s: &str) -> String {
    s.escape_debug().to_string().replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('|', "\\|").replace('`', "\\`")
}

/// Quotes `s` for a shell: bare when safe, in single quotes otherwise, and as bash's `$'...'`
/// (newlines and other control characters escaped) when it holds a control character, so a
/// pasted command keeps exactly the same bytes.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,@".contains(c)) {
        s.to_string()
    } else if s.chars().any(char::is_control) {
        let mut o = String::from("$'");
        for c in s.chars() {
            match c {
                '\n' => o.push_str("\\n"),
                '\t' => o.push_str("\\t"),
                '\r' => o.push_str("\\r"),
                '\\' => o.push_str("\\\\"),
                '\'' => o.push_str("\\'"),
                c if c.is_control() => o.push_str(&format!("\\u{:04x}", c as u32)),
                c => o.push(c),
            }
        }
        o.push('\'');
        o
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Lower-case hex of `bytes` (a sha256 digest as trace headers write it).
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Flattens a JSON value into (dotted key path, leaf value) pairs, depth first in key order:
/// `{"a": {"b": 1}, "c": [2]}` → `[("a.b", 1), ("c", [2])]`. Arrays and scalars are leaves; a
/// value that is not an object is one pair with an empty key.
pub fn flatten_json(v: &serde_json::Value) -> Vec<(String, serde_json::Value)> {
    fn walk(prefix: &str, v: &serde_json::Value, out: &mut Vec<(String, serde_json::Value)>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, x) in m {
                    walk(&if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") }, x, out);
                }
            }
            leaf => out.push((prefix.to_string(), leaf.clone())),
        }
    }
    let mut out = Vec::new();
    walk("", v, &mut out);
    out
}

/// "max |a-b| >= x", or what the statistics say when they cannot bound a difference they see.
pub fn bound(x: f64, below_resolution: bool) -> String {
    if x.is_nan() {
        "not bounded: one side holds NaN or ±Inf there".into()
    } else if below_resolution || x == 0.0 {
        "below the recorded statistics' resolution (--dump gives exact values)".into()
    } else {
        format!(">= {}", g(x))
    }
}
