//! Small pieces every layer uses: text for terminals and Markdown, percentiles, files written
//! safely as root, secrets scrubbed, HTTP on the wire and probe's own HTTP client, JSON values
//! read leniently.
/// A closed set of values serialized as the documented words, the one way probe names an enum:
/// `name()` gives the word, `words()` the word with spaces for people, `ALL` every value in
/// order and `WORDS` their words, `FromStr` reads a word back (at the edge: flags, older files).
/// Compare the values, never their words.
///
/// A set another program may widen (a kernel's sysfs words, NVML's reasons) ends with a catch-all
/// after the braces, `Other(String)`: a word not listed is kept as it came and written back the
/// same, so nothing read is lost. Such a set is not `Copy` and has no `Default` unless the type
/// gives one; `name()` borrows, `From<String>` reads a word (never fails: `FromStr` too), and
/// values compare and order by their words, as the strings they replace did.
#[macro_export]
macro_rules! closed_set {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident = $w:literal),+ $(,)? } $(#[$om:meta])* $other:ident(String)) => {
        $(#[$m])*
        #[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
        #[serde(from = "String", into = "String")]
        pub enum $name {
            $($(#[$vm])* $v,)+
            $(#[$om])* $other(String),
        }
        impl $name {
            /// The listed values (not the catch-all).
            pub const ALL: &[$name] = &[$($name::$v),+];
            /// Every listed word, in [`Self::ALL`]'s order.
            pub const WORDS: &[&str] = &[$($w),+];
            pub fn name(&self) -> &str {
                match self { $($name::$v => $w,)+ $name::$other(w) => w }
            }
            /// The word for people: `sw_power_cap` → "sw power cap".
            pub fn words(&self) -> String {
                self.name().replace('_', " ")
            }
        }
        impl From<String> for $name {
            fn from(s: String) -> $name {
                match s.as_str() { $($w => $name::$v,)+ _ => $name::$other(s) }
            }
        }
        impl From<&str> for $name {
            fn from(s: &str) -> $name {
                $name::from(s.to_string())
            }
        }
        impl From<$name> for String {
            fn from(v: $name) -> String {
                match v { $name::$other(w) => w, v => v.name().to_string() }
            }
        }
        impl std::str::FromStr for $name {
            type Err = std::convert::Infallible;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Ok($name::from(s))
            }
        }
        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
        // By the word: `Other("active")`, built by hand, is `Active`.
        impl PartialEq for $name {
            fn eq(&self, o: &Self) -> bool {
                self.name() == o.name()
            }
        }
        impl Eq for $name {}
        impl std::hash::Hash for $name {
            fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
                self.name().hash(h)
            }
        }
        impl PartialOrd for $name {
            fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(o))
            }
        }
        impl Ord for $name {
            fn cmp(&self, o: &Self) -> std::cmp::Ordering {
                self.name().cmp(o.name())
            }
        }
    };
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
