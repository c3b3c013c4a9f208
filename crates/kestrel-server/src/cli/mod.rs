//! The `kestrel` subcommands (`serve`, `generate`, `chat`) and what they share:
//! the engine's flags, the sampling flags and the terminal client.

pub(crate) mod chat;
pub(crate) mod client;
pub(crate) mod engine;
pub(crate) mod generate;
pub(crate) mod sampling;
pub(crate) mod serve;
