//! Small pieces every layer uses: text for terminals and Markdown, percentiles, files written
//! safely as root, secrets scrubbed, HTTP on the wire and probe's own HTTP client.
pub mod http;
pub mod httpc;
pub mod output;
pub mod redact;
pub mod stats;
pub mod text;
