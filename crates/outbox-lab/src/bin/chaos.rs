//! `cargo xtask chaos`: the outbox → broker → inbox pipeline under real faults, and a
//! verdict that counts every message. See `src/chaos/mod.rs` for what a run does, and
//! `docs/chaos.md` for how to run it and what it showed.
//!
//! The run holds the machine-wide fault lock of `outboxkit_testkit::faults` from start to
//! end. Every fault is undone by a guard that runs on drop: when the run ends, fails,
//! panics, or is interrupted (SIGINT or SIGTERM stop it: the run is dropped, which
//! undoes the fault in force and kills the processes it started). Exit codes: 0 the
//! verdict passed, 1 it failed, 2 the run could not be set up, 130 interrupted.

use std::process::ExitCode;

use clap::Parser as _;
use outboxkit_lab::chaos::{self, args::Args};

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,sqlx=error".into()),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    chaos::main(Args::parse()).await
}
