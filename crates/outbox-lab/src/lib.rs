//! The project's measuring and breaking tools (not published; the orders demo in
//! `examples/orders` is the main job, these are not). The `bench`, `chaos` and
//! `chaos-consumer` binaries are each a thin `main` over one of its modules:
//!
//! - [`bench`](mod@bench): `cargo xtask bench`, relay and consumer throughput against ceilings
//!   measured in the same run;
//! - [`chaos`]: `cargo xtask chaos`, the pipeline under real faults and a verdict that
//!   counts every message; [`chaos::consumer`] is its consumer process;
//! - [`common`]: service URLs, percentiles, CPU and memory figures, waiting for idle
//!   cores.

pub mod bench;
pub mod chaos;
pub mod common;
