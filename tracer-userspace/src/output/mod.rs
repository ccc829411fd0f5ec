//! Writers for decided flows: human text lines and JSON lines. Both are
//! generic over `io::Write` and hold no state beyond formatting options, so
//! the live run and a later offline analysis print the same thing.
pub mod json;
pub mod text;

#[cfg(test)]
mod tests;
