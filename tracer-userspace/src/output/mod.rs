//! Writers for decided flows: human text lines, JSON lines and pcapng. They
//! hold no state beyond formatting options (and the pcapng interface table),
//! so the live run and a later offline analysis print the same thing.
pub mod clean;
pub mod files;
pub mod json;
mod ok_line;
pub mod pcapng;
pub mod queue;
mod scan;
pub mod sink;
pub mod text;

#[cfg(test)]
mod tests;
