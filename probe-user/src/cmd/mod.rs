//! The subcommands' own code (the clap definitions live in main.rs).
pub mod doctor;
