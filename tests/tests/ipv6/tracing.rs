//! Tracing IPv6 flows (filled in once the core branch lands).
