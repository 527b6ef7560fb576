//! What may leave the machine. Secrets are removed from everything probe records or bundles,
//! always: values of options and variables named like keys, tokens or passwords (`--api-key`,
//! `HF_TOKEN=`), passwords in URLs, bearer tokens, secret query parameters, HTTP credential
//! headers, raw kernel addresses (KASLR). `--mask` ([`Masker`]) also hides what names the
//! machine and its user (directories, hosts, IP addresses, query strings, GPU UUIDs) while
//! keeping what a maintainer needs: file base names and the server's API paths.
use std::{collections::BTreeSet, sync::LazyLock};

use regex::{Captures, Regex};

/// What a removed secret reads as. Brackets, not angle brackets: safe inside SVG and HTML.
pub const REDACTED: &str = "[redacted]";

/// Whether an option or variable named `name` holds a secret: one of its words (split at `-`,
/// `_`, `.`) is, or ends with, key / token / secret / password / auth / credential / cookie.
/// `--max-tokens`, `--tokenizer` or `--n-keep` are not secrets.
pub fn is_secret_name(name: &str) -> bool {
    const WORDS: [&str; 11] =
        ["key", "token", "secret", "password", "passwd", "pass", "auth", "credential", "credentials", "cookie", "apikey"];
    name.trim_start_matches('-')
        .split(['-', '_', '.'])
        .map(str::to_ascii_lowercase)
        .any(|w| WORDS.iter().any(|s| w == *s || (w.len() > s.len() && w.ends_with(s) && *s != "pass" && *s != "auth")))
}

/// A command line (arguments as the process got them) with secret values replaced: `--api-key
/// X`, `--api-key=X`, `HF_TOKEN=X`, and whatever [`scrub`] removes from every argument.
pub fn command_line(args: &[String]) -> String {
    let mut out: Vec<String> = Vec::with_capacity(args.len());
    let mut hide_next = false;
    for a in args {
        if hide_next && !a.starts_with('-') {
            out.push(REDACTED.into());
            hide_next = false;
            continue;
        }
        hide_next = false;
        match a.split_once('=') {
            Some((name, _)) if is_secret_name(name) && !name.contains(['/', ' ']) => out.push(format!("{name}={REDACTED}")),
            _ if a.starts_with('-') && a.len() > 1 && is_secret_name(a) => {
                hide_next = true;
                out.push(a.clone());
            }
            _ => out.push(scrub(a)),
        }
    }
    out.join(" ")
}

static ENV_LIKE: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\b([A-Za-z][A-Za-z0-9_.-]*)=([^\s&\x22'`,;]+)").expect("valid regex"));
static URL_PASSWORD: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"([a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]+):[^/\s@]+@").expect("valid regex"));
static BEARER: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}").expect("valid regex"));
static KERNEL_ADDR: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\b(0x)?ffff[0-9a-f]{12}\b").expect("valid regex"));

/// Secrets removed from free text (a command line, a report, a timeline, a flamegraph):
/// `name=value` where the name is a secret's ([`is_secret_name`]; also query parameters),
/// URL passwords, bearer/basic credentials, and raw kernel addresses (`0xffff…`: with KASLR
/// they tell where the kernel is).
pub fn scrub(text: &str) -> String {
    let t =
        ENV_LIKE.replace_all(text, |c: &Captures| if is_secret_name(&c[1]) { format!("{}={REDACTED}", &c[1]) } else { c[0].to_string() });
    let t = URL_PASSWORD.replace_all(&t, |c: &Captures| format!("{}:{REDACTED}@", &c[1]));
    let t = BEARER.replace_all(&t, |c: &Captures| format!("{} {REDACTED}", &c[1]));
    KERNEL_ADDR.replace_all(&t, "[kernel address]").into_owned()
}

/// HTTP headers whose values are credentials (sent, and set by the server: `Set-Cookie`).
const CREDENTIAL_HEADERS: [&[u8]; 10] = [
    b"authorization:",
    b"proxy-authorization:",
    b"cookie:",
    b"set-cookie:",
    b"x-api-key:",
    b"api-key:",
    b"x-auth-token:",
    b"x-goog-api-key:",
    b"x-amz-security-token:",
    b"private-token:",
];

/// Overwrite, in place, the credentials in raw HTTP bytes with `*`, keeping every length (the
/// stream parser and the recording's byte counts stay right): the values of credential headers
/// (`Authorization`, `Cookie`, `X-Api-Key`, …) and of secret query parameters in a request line
/// (`?api_key=`), within one buffer ([`CredentialStream`] carries headers across reads).
pub fn http_credentials_in_place(buf: &mut [u8]) {
    let mut line_start = 0;
    while line_start < buf.len() {
        let end = buf[line_start..].iter().position(|&c| c == b'\n').map_or(buf.len(), |i| line_start + i);
        let line = &buf[line_start..end];
        if let Some(h) = CREDENTIAL_HEADERS.iter().find(|h| line.len() >= h.len() && line[..h.len()].eq_ignore_ascii_case(h)) {
            let from = line_start + h.len();
            for c in &mut buf[from..end] {
                if *c != b'\r' && *c != b' ' {
                    *c = b'*';
                }
            }
        } else if let Some(q) = line.iter().position(|&c| c == b'?') {
            // A request line: METHOD /path?query HTTP/1.1 (the query ends at a space).
            let q_end = line[q..].iter().position(|&c| c == b' ' || c == b'\r').map_or(line.len(), |i| q + i);
            let mut at = line_start + q + 1;
            let stop = line_start + q_end;
            while at < stop {
                let next = buf[at..stop].iter().position(|&c| c == b'&').map_or(stop, |i| at + i);
                if let Some(eq) = buf[at..next].iter().position(|&c| c == b'=') {
                    let secret = std::str::from_utf8(&buf[at..at + eq]).is_ok_and(is_secret_name);
                    if secret {
                        buf[at + eq + 1..next].fill(b'*');
                    }
                }
                at = next + 1;
            }
        }
        line_start = end + 1;
    }
}

/// Credential headers masked across reads: the state of one direction of one connection,
/// carried from one read (or write) to the next, so a header whose name, value or both are split
/// over several reads is still hidden (`Author` | `ization: Bea` | `rer sk-…`).
#[derive(Clone, Debug, Default)]
pub struct CredentialStream {
    /// The start of the current line, while it may still be a header name (up to its `:`).
    name: Vec<u8>,
    /// Past the start of the line (a name too long, or a `:` already seen): not a name.
    mid_line: bool,
    /// Inside a credential header's value, until the end of its line.
    in_value: bool,
    /// Inside a query string (after a `?`, until a space or the line's end), with the name of
    /// the parameter being read (up to its `=`), or inside a secret parameter's value.
    in_query: bool,
    param: Vec<u8>,
    param_long: bool,
    in_secret: bool,
}

/// Longest header name looked for, with its colon.
const NAME_MAX: usize = 24;

impl CredentialStream {
    /// Mask `buf` in place, the next bytes of this stream: a credential header's value becomes
    /// `*` (spaces and line ends kept, so every length stays), wherever the read boundaries fall.
    /// Secret query parameters are masked per read, as [`http_credentials_in_place`] does.
    pub fn mask(&mut self, buf: &mut [u8]) {
        for c in buf.iter_mut() {
            if *c == b'\n' {
                self.name.clear();
                (self.mid_line, self.in_value) = (false, false);
                self.end_query();
            } else if self.in_query {
                self.query_byte(c);
            } else if *c == b'?' && !self.in_value {
                self.in_query = true;
                self.mid_line = true;
            } else if self.in_value {
                if *c != b'\r' && *c != b' ' {
                    *c = b'*';
                }
            } else if !self.mid_line {
                self.name.push(*c);
                if *c == b':' {
                    self.in_value = CREDENTIAL_HEADERS.iter().any(|h| self.name.eq_ignore_ascii_case(h));
                    self.mid_line = true;
                } else if self.name.len() >= NAME_MAX {
                    self.mid_line = true;
                }
            }
        }
        http_credentials_in_place(buf);
    }

    fn end_query(&mut self) {
        (self.in_query, self.in_secret, self.param_long) = (false, false, false);
        self.param.clear();
    }

    /// One byte of a query string: a secret parameter's value becomes `*`, however the reads
    /// split its name or value.
    fn query_byte(&mut self, c: &mut u8) {
        match *c {
            b' ' | b'\r' | b'#' => self.end_query(),
            b'&' | b';' => {
                (self.in_secret, self.param_long) = (false, false);
                self.param.clear();
            }
            _ if self.in_secret => *c = b'*',
            b'=' if !self.param_long => {
                self.in_secret = std::str::from_utf8(&self.param).is_ok_and(is_secret_name);
                self.param_long = true;
            }
            _ if self.param_long => {}
            _ if self.param.len() >= NAME_MAX * 2 => self.param_long = true,
            _ => self.param.push(*c),
        }
    }
}

static GPU_UUID: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\b(GPU|MIG)-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b").expect("valid regex")
});
/// A long hexadecimal id (a container's, a cgroup scope's, a machine's): 12 digits or more, not
/// an address (`0x…` has no word boundary before its digits).
static HEX_ID: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\b[0-9a-f]{12,}\b").expect("valid regex"));
static QUERY: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"(/[A-Za-z0-9._~%/+-]*)\?[^\s\x22'`()<>|\[\]{}]+").expect("valid regex"));
static URL_HOST: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\b([a-zA-Z][a-zA-Z0-9+.-]*)://(?:[^/\s@]+@)?(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)").expect("valid regex"));

/// `v` with `clean` applied to each of its strings, map keys included: every string is cleaned
/// on its own, so no pattern can reach across a field or into the JSON around it, and what comes
/// back is the same type, whole.
pub fn clean_values<T: serde::Serialize + serde::de::DeserializeOwned>(v: &T, clean: &dyn Fn(&str) -> String) -> serde_json::Result<T> {
    fn walk(v: serde_json::Value, clean: &dyn Fn(&str) -> String) -> serde_json::Value {
        use serde_json::Value;
        match v {
            Value::String(s) => Value::String(clean(&s)),
            Value::Array(a) => Value::Array(a.into_iter().map(|x| walk(x, clean)).collect()),
            Value::Object(o) => Value::Object(o.into_iter().map(|(k, x)| (clean(&k), walk(x, clean))).collect()),
            other => other,
        }
    }
    serde_json::from_value(walk(serde_json::to_value(v)?, clean))
}

/// `--mask`: hide directories, hosts, IP addresses, query strings and GPU UUIDs; keep file base
/// names, ports, and the API paths the server was asked for (they are what a maintainer reads).
#[derive(Debug, Default)]
pub struct Masker {
    /// Request paths seen (without query): `/v1/chat/completions` stays as it is.
    api_paths: BTreeSet<String>,
    /// This machine's names (hostname, FQDN): hidden wherever they appear.
    hosts: Vec<String>,
}

impl Masker {
    /// `api_paths`: the request paths of the report; the machine's own hostname is read here.
    pub fn new<'a>(api_paths: impl IntoIterator<Item = &'a str>) -> Masker {
        let mut hosts = Vec::new();
        for f in ["/proc/sys/kernel/hostname", "/etc/hostname"] {
            if let Ok(h) = std::fs::read_to_string(f) {
                let h = h.trim().to_string();
                if h.len() > 2 && h != "localhost" && !hosts.contains(&h) {
                    hosts.push(h);
                }
            }
        }
        let api_paths = api_paths.into_iter().map(|p| p.split('?').next().unwrap_or(p).to_string()).filter(|p| p.len() > 1).collect();
        Masker { api_paths, hosts }
    }

    /// `text` with secrets scrubbed and identifying names hidden.
    pub fn mask(&self, text: &str) -> String {
        let mut t = scrub(text);
        for h in &self.hosts {
            t = t.replace(h.as_str(), "<host>");
        }
        let t = GPU_UUID.replace_all(&t, "$1-<uuid>");
        let t = HEX_ID.replace_all(&t, "<id>");
        let t = URL_HOST.replace_all(&t, |c: &Captures| {
            let host = &c[2];
            if host == "localhost" { c[0].to_string() } else { format!("{}://<host>", &c[1]) }
        });
        // Query strings go first, whole (their `=` and `&` would split words below); a marker
        // without separators stands in until the words are done.
        let t = QUERY.replace_all(&t, "$1?\u{1}q");
        self.words(&t).replace("?\u{1}q", "?<query>")
    }

    fn words(&self, text: &str) -> String {
        const SEP: &str = "\"'`(),;|[]{}<>=";
        let mut out = String::with_capacity(text.len());
        for token in text.split_inclusive(|c: char| c.is_whitespace() || SEP.contains(c)) {
            let (word, sep) = match token.char_indices().last() {
                Some((i, c)) if c.is_whitespace() || SEP.contains(c) => (&token[..i], &token[i..]),
                _ => (token, ""),
            };
            out.push_str(&self.word(word));
            out.push_str(sep);
        }
        out
    }

    fn word(&self, word: &str) -> String {
        // A word ending a clause (`127.0.0.1:8080:`, `/a/b.`) is the word without its stop.
        if let Some(w) = word.strip_suffix([':', '.']).filter(|w| !w.is_empty()) {
            let stop = &word[w.len()..];
            return format!("{}{stop}", self.word(w));
        }
        let (path, query) = match word.split_once("?\u{1}q") {
            Some((p, _)) => (p, true),
            None => (word, false),
        };
        let with_query = |p: String| if query { format!("{p}?\u{1}q") } else { p };
        if self.api_paths.contains(path) {
            return with_query(path.to_string());
        }
        let base = || path.rsplit('/').next().unwrap_or("");
        // Absolute (two or more components), home (~/…) and explicitly relative (./, ../) paths,
        // and bare relative paths to a file with an extension (models/m.gguf): directories
        // go. A unit like `tok/s` or `ms/s` has no extension and stays.
        let relative_file = !path.starts_with('/')
            && !path.contains("://")
            && path.contains('/')
            && base().contains('.')
            && !base().ends_with('.')
            && path.chars().next().is_some_and(|c| c.is_alphanumeric() || c == '_');
        if (path.starts_with('/') && path.matches('/').count() > 1)
            || path.starts_with("~/")
            || path.starts_with("./")
            || path.starts_with("../")
            || relative_file
        {
            return with_query(format!("<dir>/{}", base()));
        }
        if query {
            return with_query(path.to_string());
        }
        if let Some((_, port)) = word.rsplit_once(':').filter(|(h, p)| {
            p.chars().all(|c| c.is_ascii_digit())
                && (h.parse::<std::net::Ipv4Addr>().is_ok() || h.trim_matches(['[', ']']).parse::<std::net::Ipv6Addr>().is_ok())
        }) {
            return format!("<ip>:{port}");
        }
        if word.parse::<std::net::IpAddr>().is_ok() {
            return "<ip>".into();
        }
        word.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split(' ').map(String::from).collect()
    }

    /// Values are cleaned one by one, keys too: a string's neighbours in the text (a colon after
    /// an address, a quote) cannot hide it, and the JSON stays whole.
    #[test]
    fn values_are_cleaned_one_by_one() {
        let m = Masker { api_paths: BTreeSet::new(), hosts: vec![] };
        let v: std::collections::BTreeMap<String, Vec<String>> =
            [("/home/u/models/m.gguf".to_string(), vec!["127.0.0.1:37443".to_string(), "HF_TOKEN=hf_abc\"x".to_string()])].into();
        let c = clean_values(&v, &|s: &str| m.mask(s)).unwrap();
        let (k, vals) = c.iter().next().unwrap();
        assert_eq!(k, "<dir>/m.gguf");
        assert_eq!(vals[0], "<ip>:37443");
        assert!(!vals[1].contains("hf_abc"), "{}", vals[1]);
    }

    #[test]
    fn secret_options_and_variables_lose_their_values() {
        let c = command_line(&args(
            "llama-server -m /m/x.gguf --api-key sk-live-123 --hf-token=hf_abc --max-tokens 64 --tokenizer tok --n-keep 4 --no-auth --port 8080",
        ));
        assert_eq!(
            c,
            "llama-server -m /m/x.gguf --api-key [redacted] --hf-token=[redacted] --max-tokens 64 --tokenizer tok --n-keep 4 --no-auth --port 8080"
        );
        assert_eq!(command_line(&args("env OPENAI_API_KEY=sk-1 VLLM_PORT=8000 vllm")), "env OPENAI_API_KEY=[redacted] VLLM_PORT=8000 vllm");
        assert!(!is_secret_name("--max-num-batched-tokens") && !is_secret_name("--keep") && !is_secret_name("--author"));
        assert!(is_secret_name("--ssl-key-file") && is_secret_name("HUGGING_FACE_HUB_TOKEN") && is_secret_name("--password"));
    }

    #[test]
    fn scrub_removes_urls_passwords_bearer_query_secrets_and_kernel_addresses() {
        assert_eq!(
            scrub("GET /v1/models?api_key=abc123&n=2 from https://bob:hunter2@example.com/x Authorization: Bearer abcdefghijkl"),
            "GET /v1/models?api_key=[redacted]&n=2 from https://bob:[redacted]@example.com/x Authorization: Bearer [redacted]"
        );
        assert_eq!(scrub("0xffffffff81234567 [unknown] ffff888100a3b000"), "[kernel address] [unknown] [kernel address]");
        assert_eq!(scrub("TTFT 241 ms; 93.8 MiB; n_ctx=4096"), "TTFT 241 ms; 93.8 MiB; n_ctx=4096");
    }

    #[test]
    fn credentials_are_overwritten_in_place() {
        let mut b =
            b"POST /v1/x?n=1&api_key=sk-7 HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer sk-9\r\nx-api-key:k1\r\n\r\n{\"q\":\"why?\"}"
                .to_vec();
        let len = b.len();
        http_credentials_in_place(&mut b);
        assert_eq!(b.len(), len);
        assert_eq!(
            String::from_utf8(b).unwrap(),
            "POST /v1/x?n=1&api_key=**** HTTP/1.1\r\nHost: a\r\nAuthorization: ****** ****\r\nx-api-key:**\r\n\r\n{\"q\":\"why?\"}"
        );
    }

    /// `Authorization: Bearer …` and a secret query parameter split over two and three reads at
    /// every point: the values are hidden whole, lengths kept, the other headers untouched.
    #[test]
    fn set_cookie_is_masked() {
        let mut b = b"HTTP/1.1 200 OK\r\nSet-Cookie: session=abc123; HttpOnly\r\nContent-Length: 2\r\n\r\n{}".to_vec();
        CredentialStream::default().mask(&mut b);
        assert_eq!(String::from_utf8(b).unwrap(), "HTTP/1.1 200 OK\r\nSet-Cookie: *************** ********\r\nContent-Length: 2\r\n\r\n{}");
    }

    #[test]
    fn credentials_split_across_reads_are_masked() {
        let raw = b"POST /v1/chat?n=2&api_key=sk-q-9 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-secret-123\r\nX-Other: keep\r\n\r\n{}";
        let want =
            b"POST /v1/chat?n=2&api_key=****** HTTP/1.1\r\nHost: x\r\nAuthorization: ****** *************\r\nX-Other: keep\r\n\r\n{}";
        for a in 0..raw.len() {
            for b in a..raw.len() {
                let mut bytes = raw.to_vec();
                let mut st = CredentialStream::default();
                let (x, rest) = bytes.split_at_mut(a);
                let (y, z) = rest.split_at_mut(b - a);
                for part in [x, y, z] {
                    st.mask(part);
                }
                assert_eq!(String::from_utf8_lossy(&bytes), String::from_utf8_lossy(want), "split at {a} and {b}");
            }
        }
    }

    #[test]
    fn mask_hides_machine_names_but_keeps_api_paths_and_base_names() {
        let m = Masker { api_paths: ["/v1/chat/completions".to_string()].into(), hosts: vec!["gpubox".into()] };
        assert_eq!(
            m.mask("read /home/alice/models/m.gguf from 192.168.1.7:8080 and [::1]:80"),
            "read <dir>/m.gguf from <ip>:8080 and [<ip>]:80"
        );
        assert_eq!(m.mask("`POST /v1/chat/completions?user=alice` on gpubox"), "`POST /v1/chat/completions?<query>` on <host>");
        assert_eq!(m.mask("~/m/x.gguf ./a/b.bin models/q4.gguf 12 tok/s"), "<dir>/x.gguf <dir>/b.bin <dir>/q4.gguf 12 tok/s");
        assert_eq!(m.mask("GPU-8a1b2c3d-1111-2222-3333-444455556666 at http://ai.lan:11434/api"), "GPU-<uuid> at http://<host>:11434/api");
        assert_eq!(m.mask("TTFT 241 ms; 93.8 MiB"), "TTFT 241 ms; 93.8 MiB");
        // Container and cgroup ids, whole or in a scope's name; an address stays.
        assert_eq!(
            m.mask("cgroup /system.slice/docker-3f2a9c8b7d6e5f40a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6e7f8a9b0c1d2e3f4.scope, memcg /process_api/9621df7e4ef7ecbdc164fae23ee28635"),
            "cgroup <dir>/docker-<id>.scope, memcg <dir>/<id>"
        );
        assert_eq!(m.mask("llama-server+0x55b8a4569df0"), "llama-server+0x55b8a4569df0");
        assert_eq!(
            m.mask("server: other at 127.0.0.1:36705: build b1, read /srv/m/x.gguf."),
            "server: other at <ip>:36705: build b1, read <dir>/x.gguf."
        );
    }
}
