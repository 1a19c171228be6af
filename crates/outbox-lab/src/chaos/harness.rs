//! The harness as a process: the machine-wide fault lock held from start to end, the
//! servers' state before and after, SIGINT and SIGTERM, and the exit code.

use std::process::ExitCode;

use tokio::signal::unix::{SignalKind, signal};

use super::args::Args;
use super::servers;

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

/// The `chaos` binary: validates `args`, takes the fault lock and runs the harness until
/// its verdict or a signal. Exit codes: 0 the verdict passed, 1 it failed, 2 the run could
/// not be set up, 130 interrupted.
pub async fn main(args: Args) -> ExitCode {
    if let Err(e) = args.validate() {
        eprintln!("chaos: {e:#}");
        return ExitCode::from(2);
    }
    let seed = args.seed.unwrap_or_else(rand::random);
    super::db::use_database(args.database);
    println!(
        "chaos: seed {seed} (repeat this run with --seed {seed}); database {}, transport {}, fault phase {}",
        args.database.name(),
        args.transport.name(),
        humantime::format_duration(args.duration)
    );
    println!(
        "chaos: taking the machine-wide fault lock {}",
        outboxkit_testkit::faults::lock_path().display()
    );
    let _lock = outboxkit_testkit::faults::lock().await;
    if args.cluster {
        // Relays, consumers and the harness's own connections: every node.
        crate::common::use_cluster();
        println!(
            "chaos: on the clusters: {} and {}",
            crate::common::amqp_url(),
            crate::common::nats_url()
        );
    }
    let (cluster, database) = (args.cluster, args.database);
    let before = match tokio::task::spawn_blocking(move || servers::before(cluster, database)).await
    {
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
    let mut run = tokio::spawn(super::run(args, seed, before.clone()));
    tokio::select! {
        result = &mut run => match result {
            Ok(Ok(true)) => ExitCode::SUCCESS,
            Ok(Ok(false)) => ExitCode::FAILURE,
            Ok(Err(e)) => {
                eprintln!("chaos: the run could not go on: {e:#}");
                report_servers(&before, cluster).await;
                ExitCode::from(2)
            }
            Err(e) => {
                eprintln!("chaos: the run panicked: {e}");
                report_servers(&before, cluster).await;
                ExitCode::from(2)
            }
        },
        signal = interrupted() => {
            eprintln!("chaos: {signal}: undoing the fault in force and stopping the processes");
            run.abort();
            let _ = run.await;
            report_servers(&before, cluster).await;
            eprintln!("chaos: interrupted (seed {seed}); no verdict");
            ExitCode::from(130)
        }
    }
}

/// Prints whether the servers are as the run found them.
async fn report_servers(before: &servers::Snapshot, cluster: bool) {
    let before = before.clone();
    if let Ok((lines, _)) =
        tokio::task::spawn_blocking(move || servers::after(&before, cluster)).await
    {
        for l in lines {
            eprintln!("chaos: servers: {l}");
        }
    }
}
