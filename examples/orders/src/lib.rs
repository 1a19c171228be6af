//! The orders example's library: the benchmark and the chaos harness, and what they share
//! with the demo. The `bench`, `chaos` and `chaos-consumer` binaries are each a thin
//! `main` over one of its modules:
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
