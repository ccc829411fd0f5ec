#![no_std]
// Host builds of this crate exist only so tracer-userspace's build.rs can depend on it
// (aya-build rebuilds the object when this crate changes); the programs live in main.rs.
