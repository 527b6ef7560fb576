//! Small pieces every layer uses: text for terminals and Markdown, percentiles, files written
//! safely as root, secrets scrubbed, HTTP on the wire and probe's own HTTP client, JSON values
//! read leniently.
/// A closed set of values serialized as the documented words, the one way probe names an enum:
/// `name()` gives the word, `words()` the word with spaces for people, `ALL` every value in
/// order and `WORDS` their words, `FromStr` reads a word back (at the edge: flags, older files).
/// Compare the values, never their words.
#[macro_export]
macro_rules! closed_set {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident = $w:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
        pub enum $name {
            $($(#[$vm])* #[serde(rename = $w)] $v,)+
        }
        impl $name {
            pub const ALL: &[$name] = &[$($name::$v),+];
            /// Every word, in [`Self::ALL`]'s order.
            pub const WORDS: &[&str] = &[$($w),+];
            pub fn name(self) -> &'static str {
                match self { $($name::$v => $w),+ }
            }
            /// The word for people: `client_disconnect` → "client disconnect".
            pub fn words(self) -> String {
                self.name().replace('_', " ")
            }
        }
        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
        impl std::str::FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                $name::ALL.iter().copied().find(|c| c.name() == s).ok_or_else(|| format!("`{s}` is not a {}", stringify!($name)))
            }
        }
    };
}

/// A JSON value read as a `T` without failing: `Is` when it is one, `Not` when it is any other
/// value (as `Value::as_str` and `as_bool` read one). For what must never fail a read: a
/// record's `type`, the words of records older probes wrote.
#[derive(serde::Deserialize)]
#[serde(untagged)]
pub enum Lenient<T> {
    Is(T),
    Not(serde::de::IgnoredAny),
}

impl<T> Lenient<T> {
    pub fn ok(self) -> Option<T> {
        match self {
            Lenient::Is(t) => Some(t),
            Lenient::Not(_) => None,
        }
    }
}

pub mod http;
pub mod httpc;
pub mod output;
pub mod redact;
pub mod stats;
pub mod text;
