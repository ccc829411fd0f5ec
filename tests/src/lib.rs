//! The lab.
