//! `cargo xtask chaos`: the outbox → broker → inbox pipeline under real faults, and a
//! verdict that counts every message. See `src/chaos/mod.rs` for what a run does, and
//! the README's "Chaos" section for how to run it and what it showed.
//!
//! The run holds the machine-wide fault lock of `outbox_testkit::faults` from start to
//! end. Every fault is undone by a guard that runs on drop: when the run ends, fails,
//! panics, or is interrupted (SIGINT or SIGTERM stop it: the run is dropped, which
//! undoes the fault in force and kills the processes it started). Exit codes: 0 the
//! verdict passed, 1 it failed, 2 the run could not be set up, 130 interrupted.

#[path = "../chaos/mod.rs"]
mod chaos;
#[path = "../common.rs"]
mod common;

use std::process::ExitCode;

use clap::Parser as _;
use tokio::signal::unix::{SignalKind, signal};

use chaos::args::Args;

async fn interrupted() -> &'static str {
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return "SIGINT";
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,sqlx=error".into()),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    if let Err(e) = args.validate() {
        eprintln!("chaos: {e:#}");
        return ExitCode::from(2);
    }
    let seed = args.seed.unwrap_or_else(rand::random);
    println!(
        "chaos: seed {seed} (repeat this run with --seed {seed}); transport {}, fault phase {}",
        args.transport.name(),
        humantime::format_duration(args.duration)
    );
    println!(
        "chaos: taking the machine-wide fault lock {}",
        outbox_testkit::faults::lock_path().display()
    );
    let _lock = outbox_testkit::faults::lock().await;
    let before = match tokio::task::spawn_blocking(chaos::servers::before).await {
        Ok(Ok(before)) => before,
        Ok(Err(e)) => {
            eprintln!("chaos: {e:#}");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("chaos: {e}");
            return ExitCode::from(2);
        }
    };
    let mut run = tokio::spawn(chaos::run(args, seed, before.clone()));
    tokio::select! {
        result = &mut run => match result {
            Ok(Ok(true)) => ExitCode::SUCCESS,
            Ok(Ok(false)) => ExitCode::FAILURE,
            Ok(Err(e)) => {
                eprintln!("chaos: the run could not go on: {e:#}");
                report_servers(&before).await;
                ExitCode::from(2)
            }
            Err(e) => {
                eprintln!("chaos: the run panicked: {e}");
                report_servers(&before).await;
                ExitCode::from(2)
            }
        },
        signal = interrupted() => {
            eprintln!("chaos: {signal}: undoing the fault in force and stopping the processes");
            run.abort();
            let _ = run.await;
            report_servers(&before).await;
            eprintln!("chaos: interrupted (seed {seed}); no verdict");
            ExitCode::from(130)
        }
    }
}

/// Prints whether the servers are as the run found them.
async fn report_servers(before: &chaos::servers::Snapshot) {
    let before = before.clone();
    if let Ok((lines, _)) =
        tokio::task::spawn_blocking(move || chaos::servers::after(&before)).await
    {
        for l in lines {
            eprintln!("chaos: servers: {l}");
        }
    }
}
