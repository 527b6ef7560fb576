//! Text that came from the target or the network is data: process and thread names (the target
//! sets them), file names, request paths and strings from the server's JSON. These are the two
//! sanitizers for where it is shown: a terminal (escape sequences would drive a root terminal)
//! and Markdown (a backtick or a pipe would break out of a code span or a table). HTML has its
//! own escaping in `html`.
use std::{borrow::Cow, fmt::Write as _};

/// Characters that act on a terminal or reorder what it shows: C0 controls except newline and
/// tab, DEL, C1 controls (CSI, OSC as single code points), and the bidirectional overrides and
/// isolates (which make shown text differ from the bytes).
fn unsafe_for_terminal(c: char) -> bool {
    (c.is_control() && c != '\n' && c != '\t') || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}')
}

thread_local! {
    /// The server this thread works for, in a process that follows several (`watch --all`):
    /// its log lines say which.
    static LOG_KEY: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Name the server this thread's log lines are about (None: the process's own lines).
pub fn set_log_key(key: Option<String>) {
    LOG_KEY.with(|k| *k.borrow_mut() = key);
}

pub fn log_key() -> Option<String> {
    LOG_KEY.with(|k| k.borrow().clone())
}

/// A log line as this thread says it: `probe watch: …` and `probe: …` lines of a thread working
/// for one server of several carry its name (`probe watch [NAME]: …`).
pub fn log_line(line: std::fmt::Arguments<'_>) -> String {
    let line = line.to_string();
    let Some(key) = log_key() else { return line };
    let rest = line.strip_prefix("probe watch: ").unwrap_or(&line);
    format!("probe watch [{key}]: {rest}")
}

/// `n` and the noun, in the plural unless n is 1: "1 request", "3 requests", "1 process",
/// "2 processes".
pub fn count(n: impl Into<u64>, noun: &str) -> String {
    let n = n.into();
    if n == 1 {
        format!("1 {noun}")
    } else if noun.ends_with('s') || noun.ends_with("sh") || noun.ends_with("ch") || noun.ends_with('x') {
        format!("{n} {noun}es")
    } else {
        format!("{n} {noun}s")
    }
}

/// `s` safe to print on a terminal: every control character shown escaped (`\x1b`, `\u{202e}`).
pub fn terminal(s: &str) -> Cow<'_, str> {
    if !s.chars().any(unsafe_for_terminal) {
        return Cow::Borrowed(s);
    }
    let mut o = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if unsafe_for_terminal(c) {
            if (c as u32) < 0x100 {
                let _ = write!(o, "\\x{:02x}", c as u32);
            } else {
                let _ = write!(o, "\\u{{{:x}}}", c as u32);
            }
        } else {
            o.push(c);
        }
    }
    Cow::Owned(o)
}

/// `s` as one line of Markdown text (a table cell or a sentence): controls escaped, line breaks
/// as spaces, and the characters that start Markdown or HTML syntax backslash-escaped.
pub fn md_text(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 8);
    for c in terminal(s).chars() {
        match c {
            '\n' | '\r' | '\t' => o.push(' '),
            '\\' | '`' | '*' | '_' | '[' | ']' | '<' | '>' | '|' | '#' | '!' | '~' | '&' => {
                o.push('\\');
                o.push(c);
            }
            _ => o.push(c),
        }
    }
    o
}

/// `s` as an inline code span: fenced with more backticks than any run inside it, pipes escaped
/// (GitHub tables split cells at `|` even inside code), controls escaped, on one line.
pub fn md_code(s: &str) -> String {
    let flat: String = terminal(s).chars().map(|c| if matches!(c, '\n' | '\r' | '\t') { ' ' } else { c }).collect();
    let flat = flat.replace('|', "\\|");
    let longest = flat.split(|c| c != '`').map(str::len).max().unwrap_or(0);
    let fence = "`".repeat(longest + 1);
    let pad = if flat.starts_with('`') || flat.ends_with('`') || flat.is_empty() { " " } else { "" };
    format!("{fence}{pad}{flat}{pad}{fence}")
}

/// A fenced code block that `s` cannot close: the fence is longer than any backtick run in it.
pub fn md_block(s: &str) -> String {
    let clean = terminal(s);
    let longest = clean.split(|c| c != '`').map(str::len).max().unwrap_or(0);
    let fence = "`".repeat((longest + 1).max(3));
    format!("{fence}\n{}\n{fence}", clean.trim_end())
}

/// A byte count for people: B, KiB, MiB...
pub fn bytes(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < U.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{n} B") } else { format!("{v:.1} {}", U[u]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_say_their_plural() {
        assert_eq!((count(1u64, "request"), count(3u64, "request")), ("1 request".to_string(), "3 requests".to_string()));
        assert_eq!((count(1u32, "process"), count(0u32, "process")), ("1 process".to_string(), "0 processes".to_string()));
    }

    #[test]
    fn terminal_escapes_controls_and_bidi_but_keeps_lines() {
        assert_eq!(terminal("llama\x1b]0;pwned\x07-server\n"), "llama\\x1b]0;pwned\\x07-server\n");
        assert_eq!(terminal("a\u{9b}31m b\u{202e}cba"), "a\\x9b31m b\\u{202e}cba");
        assert!(matches!(terminal("plain text\tok"), Cow::Borrowed(_)));
    }

    #[test]
    fn markdown_cannot_break_out_of_code_spans_tables_or_blocks() {
        assert_eq!(md_code("/v1/a`b|c"), "``/v1/a`b\\|c``");
        assert_eq!(md_code("`x`"), "`` `x` ``");
        assert_eq!(md_text("*bold* <img src=x> | [l](u)"), "\\*bold\\* \\<img src=x\\> \\| \\[l\\](u)");
        assert_eq!(md_block("a\n```\nb"), "````\na\n```\nb\n````");
        assert_eq!(md_text("x\x1b[31my"), "x\\\\x1b\\[31my");
    }
}
