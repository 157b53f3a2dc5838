//! [`Untrusted`]: a string that came from a trace file (a module path, an op name, a dtype, a
//! header or build value, a prompt or generated text). A crafted trace can put terminal escapes,
//! newlines, markdown or HTML in any of them, so the type has no `Display`: a renderer must say
//! how it prints one ([`Untrusted::text`], [`Untrusted::cell`], [`Untrusted::html`],
//! [`Untrusted::quoted`]), and escaping happens once, where the output format is known.
//!
//! Logic may read the string (`Deref<Target = str>`, comparisons with `&str`); printing it with
//! `{}` does not compile, and `{:?}` prints it quoted with control characters escaped.

use serde::Serialize;

/// A string from a trace file, printed only through an escaping method. Serialised to JSON as
/// the plain string (serde_json escapes control characters itself).
#[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct Untrusted(String);

impl Untrusted {
    /// Wraps a string read from a trace (or built from such strings).
    pub fn new(s: impl Into<String>) -> Self {
        Untrusted(s.into())
    }

    /// For a terminal: control characters (ESC, BEL, newlines, …) escaped, nothing else changed.
    pub fn text(&self) -> String {
        crate::text::clean(&self.0)
    }

    /// For a terminal, in double quotes with control characters and quotes escaped (Rust's
    /// `{:?}` of the string).
    pub fn quoted(&self) -> String {
        format!("{:?}", self.0)
    }

    /// For a markdown table cell or inline code span: see [`crate::text::cell`].
    pub fn cell(&self) -> String {
        crate::text::cell(&self.0)
    }

    /// For markdown prose (a paragraph, a list item, a quote): control characters escaped,
    /// `&`, `<`, `>` as entities (GitHub renders raw HTML) and backticks escaped (no code span
    /// can open); quotes kept.
    pub fn prose(&self) -> String {
        crate::text::clean(&self.0).replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('`', "\\`")
    }

    /// For HTML content and attribute values: control characters escaped, then `& < > " '` as
    /// entities.
    pub fn html(&self) -> String {
        crate::text::esc(&self.0)
    }

    /// For the inside of a markdown fenced code block: control characters other than newline
    /// escaped, backticks as apostrophes (so the text cannot close the fence).
    pub fn fenced(&self) -> String {
        self.0
            .chars()
            .map(|c| {
                if c == '`' {
                    "'".into()
                } else if c.is_control() && c != '\n' {
                    c.escape_debug().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect()
    }

    /// For a shell command line: see [`crate::text::shell_quote`].
    pub fn shell(&self) -> String {
        crate::text::shell_quote(&self.0)
    }

    /// The string as read, unescaped: for logic and for building another [`Untrusted`], never
    /// for output.
    pub fn unescaped(&self) -> &str {
        &self.0
    }

    /// [`Untrusted::unescaped`], under the name `String` gives it: for comparisons.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Untrusted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl std::ops::Deref for Untrusted {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl From<String> for Untrusted {
    fn from(s: String) -> Self {
        Untrusted(s)
    }
}

impl From<&str> for Untrusted {
    fn from(s: &str) -> Self {
        Untrusted(s.to_string())
    }
}

impl PartialEq<str> for Untrusted {
    fn eq(&self, o: &str) -> bool {
        self.0 == o
    }
}

impl PartialEq<&str> for Untrusted {
    fn eq(&self, o: &&str) -> bool {
        self.0 == *o
    }
}

impl PartialEq<String> for Untrusted {
    fn eq(&self, o: &String) -> bool {
        &self.0 == o
    }
}

/// The output a shared line is built for, and so how a string from a trace is escaped in it
/// (see [`Untrusted`]). The words around it are ours and safe in all three.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Out {
    /// A terminal: control characters escaped.
    Text,
    /// GitHub markdown prose (see [`Untrusted::prose`]; table cells use [`Untrusted::cell`]).
    Markdown,
    /// HTML content: entities.
    Html,
}

impl Out {
    /// `s` escaped for this output.
    pub fn u(self, s: &Untrusted) -> String {
        match self {
            Out::Text => s.text(),
            Out::Markdown => s.prose(),
            Out::Html => s.html(),
        }
    }

    /// `s` quoted and escaped for this output (a prompt or a generated text).
    pub fn q(self, s: &Untrusted) -> String {
        match self {
            Out::Text => s.quoted(),
            Out::Markdown => format!("\"{}\"", s.prose()),
            Out::Html => format!("<code>{}</code>", s.html()),
        }
    }

    /// Module paths from a trace, each escaped, comma separated.
    pub fn list(self, v: &[Untrusted]) -> String {
        v.iter().map(|p| self.u(p)).collect::<Vec<_>>().join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::Untrusted;

    #[test]
    fn every_rendering_escapes_what_a_crafted_trace_can_hold() {
        let u = Untrusted::new("\u{1b}[2J<b>|`'\n");
        assert_eq!(u.text(), "\\u{1b}[2J<b>|`'\\n");
        assert_eq!(u.quoted(), "\"\\u{1b}[2J<b>|`'\\n\"");
        assert_eq!(u.cell(), "\\u{1b}[2J&lt;b&gt;\\|\\`\\'\\n");
        assert_eq!(u.prose(), "\\u{1b}[2J&lt;b&gt;|\\`'\\n");
        assert_eq!(u.html(), "\\u{1b}[2J&lt;b&gt;|`&#39;\\n");
        assert_eq!(u.fenced(), "\\u{1b}[2J<b>|''\n");
        assert_eq!(u.shell(), "$'\\u001b[2J<b>|`\\'\\n'");
        assert_eq!(serde_json::to_string(&u).unwrap(), "\"\\u001b[2J<b>|`'\\n\"");
        assert_eq!(u, "\u{1b}[2J<b>|`'\n");
    }
}
