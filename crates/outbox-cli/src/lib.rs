//! # outboxkit-cli
//!
//! The `outbox` operations binary. Its interface is the command line (`outbox --help`,
//! `docs/operations.md`); as a library it offers only what runs that command line in
//! another program: [`Cli`] (clap), [`run`], [`main_with_args`] (the binary is a thin
//! `main.rs` over it) and [`CliError`].
//!
//! - `outbox relay`: the [`Dispatcher`](outboxkit_core::Dispatcher) over PostgreSQL or SQL
//!   Server and RabbitMQ or NATS, configured by flags, environment variables and a TOML file;
//!   serves `/metrics` (Prometheus) and `/healthz`; text or JSON logs; graceful shutdown
//!   on SIGINT/SIGTERM;
//! - `outbox migrate`, `outbox stats`, `outbox reconcile`;
//! - `outbox dead list|replay`, `outbox inbox dead list|replay`;
//! - `outbox purge` (delete or archive, in small batches);
//! - `outbox dashboard`: the operations dashboard in the browser (also mounted by
//!   `outbox relay --dashboard`);
//! - `outbox relay --source wal` and `outbox wal setup|status|drop` (PostgreSQL): the
//!   relay reading a logical replication slot instead of claiming rows
//!   (`outboxkit_postgres::wal`, docs/wal.md).
//!
//! The database is chosen by the URL (`postgres://`, `sqlserver://`,
//! `mssql://`, `jdbc:sqlserver://` or an ADO.NET string), the broker by `--transport`.
//! Cargo features pick what is compiled in: `postgres`, `sqlserver`, `rabbit`, `nats`
//! (all four by default; at least one database and one transport). A URL or
//! transport whose feature is off fails with [`CliError::FeatureMissing`] naming it.
//!
//! Every failure is a typed [`CliError`]; bad input exits with code 2, runtime
//! failures with 1. See `docs/operations.md` for examples of every command.
//!
//! ```no_run
//! use clap::Parser as _;
//! use outboxkit_cli::Cli;
//!
//! # async fn demo() -> Result<(), outboxkit_cli::CliError> {
//! let cli = Cli::parse_from(["outbox", "--database-url", "postgres://postgres@127.0.0.1/app", "stats", "--json"]);
//! outboxkit_cli::run(cli, &mut std::io::stdout()).await?;
//! # Ok(()) }
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(not(any(feature = "postgres", feature = "sqlserver", feature = "mysql")))]
compile_error!("outboxkit-cli needs a database feature: `postgres`, `sqlserver` and/or `mysql`");
#[cfg(not(any(feature = "rabbit", feature = "nats")))]
compile_error!("outboxkit-cli needs a transport feature: `rabbit` and/or `nats`");

mod cli;
mod commands;
mod config;
mod database;
mod error;
mod health;
mod output;
mod relay;
#[doc(hidden)]
pub mod testing;
#[cfg(feature = "postgres")]
mod wal;

use std::io::Write;
use std::process::ExitCode;

use chrono::Utc;
use clap::Parser as _;
use tokio_util::sync::CancellationToken;

pub use cli::Cli;
pub use error::CliError;

use crate::cli::{Command, DeadCommand, InboxCommand, InboxDeadCommand, LogFormat, RelayArgs};
use crate::commands::{Validated, dashboard, dead, inbox_dead, migrate, purge, reconcile, stats};
use crate::config::{DbSettings, FileConfig, RelaySettings};

/// Parses `args`, sets up logging, runs the command on a multi-threaded runtime and
/// maps the result to an exit code (0 ok, 1 runtime failure, 2 bad input; clap's own
/// usage errors exit with 2 as well).
pub fn main_with_args<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    let file = match load_file(&cli) {
        Ok(file) => file,
        Err(e) => return report(&e),
    };
    init_logging(
        cli.log_format
            .or(file.log_format)
            .unwrap_or(LogFormat::Text),
    );
    install_crypto_provider();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return report(&CliError::Output(e)),
    };
    match runtime.block_on(run(cli, &mut std::io::stdout())) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => report(&e),
    }
}

/// Makes `ring` the process's TLS crypto provider (rustls). With the `sqlserver`
/// feature two providers are linked (tiberius's tokio-rustls brings aws-lc-rs, sqlx,
/// lapin and async-nats use ring), and rustls refuses to pick one by itself: the first
/// TLS connection (`amqps://`, `tls://`, PostgreSQL or SQL Server over TLS) would
/// panic. Does nothing when a provider is installed already (embedding programs).
pub(crate) fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn report(e: &CliError) -> ExitCode {
    tracing::error!(error = %e, "outbox failed");
    eprintln!("outbox: error: {e}");
    ExitCode::from(e.exit_code())
}

/// Installs the tracing subscriber: `format` on stderr (colours only on a terminal),
/// level from `RUST_LOG` (default `info`; PostgreSQL notices at `warn`; lapin's
/// returned-message warnings, which include the payload, off). Does nothing when one is installed already.
pub(crate) fn init_logging(format: LogFormat) {
    use std::io::IsTerminal as _;
    use tracing_subscriber::EnvFilter;
    // sqlx logs every server NOTICE (e.g. "schema already exists") at info; lapin logs
    // each returned (unroutable) message at warn with its body, and payloads must never
    // reach the logs (the dispatcher logs the failure itself, without the payload).
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        EnvFilter::new("info,sqlx::postgres::notice=warn,lapin::returned_messages=error")
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().with_current_span(true).try_init(),
    };
}

fn load_file(cli: &Cli) -> Result<FileConfig, CliError> {
    cli.config
        .as_deref()
        .map_or_else(|| Ok(FileConfig::default()), FileConfig::load)
}

/// Runs one command, writing its output to `out`. `relay` runs until SIGINT/SIGTERM.
///
/// # Errors
/// Any [`CliError`]; input is validated before anything is changed.
pub async fn run(cli: Cli, out: &mut dyn Write) -> Result<(), CliError> {
    let file = load_file(&cli)?;
    let now = Utc::now();
    // Each arm validates its command's input; `admin` connects only if that succeeded.
    match &cli.command {
        Command::Relay(args) => run_relay(&cli, args, &file).await,
        Command::Migrate => admin(&cli, &file, migrate::validate(), out).await,
        Command::Stats(a) => admin(&cli, &file, stats::validate(a), out).await,
        Command::Reconcile(a) => admin(&cli, &file, reconcile::validate(a, now), out).await,
        Command::Dead { command } => match command {
            DeadCommand::List(a) => admin(&cli, &file, dead::validate_list(a, now), out).await,
            DeadCommand::Replay(a) => admin(&cli, &file, dead::validate_replay(a, now), out).await,
        },
        Command::Inbox {
            command: InboxCommand::Dead { command },
        } => match command {
            InboxDeadCommand::List(a) => {
                admin(&cli, &file, inbox_dead::validate_list(a, now), out).await
            }
            InboxDeadCommand::Replay(a) => {
                admin(&cli, &file, inbox_dead::validate_replay(a, now), out).await
            }
        },
        Command::Purge(a) => admin(&cli, &file, purge::validate(a), out).await,
        Command::Wal { command } => {
            let db = DbSettings::resolve(&cli, &file)?;
            commands::wal::run(&db, command, out).await
        }
        Command::Dashboard(a) => {
            let db = DbSettings::resolve(&cli, &file)?;
            let settings = dashboard::DashboardSettings::resolve(a)?;
            dashboard::run(&db, &settings).await
        }
    }
}

/// `outbox relay`: runs until SIGINT/SIGTERM.
async fn run_relay(cli: &Cli, args: &RelayArgs, file: &FileConfig) -> Result<(), CliError> {
    let settings = RelaySettings::resolve(cli, args, file)?;
    let shutdown = CancellationToken::new();
    let relay = relay::Relay::start(&settings, shutdown.clone()).await?;
    tokio::spawn(relay::cancel_on_signal(shutdown));
    relay.wait().await?;
    Ok(())
}

/// An admin command: resolves the database settings, then takes the command's
/// validation result, and only when both are good connects and runs it.
async fn admin(
    cli: &Cli,
    file: &FileConfig,
    command: Result<impl Validated, CliError>,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let db = DbSettings::resolve(cli, file)?;
    let command = command?;
    let outbox = database::connect_admin(&db).await?;
    command.run(&*outbox, out).await
}

#[cfg(test)]
mod tls_tests {
    /// With both providers linked (the default features), rustls cannot pick one by
    /// itself; after [`super::install_crypto_provider`] it can.
    #[test]
    fn the_binary_picks_a_tls_provider() {
        if cfg!(feature = "sqlserver") {
            let built = std::panic::catch_unwind(|| {
                let _ = rustls::ClientConfig::builder();
            });
            assert!(
                built.is_err(),
                "two providers linked: rustls must not choose"
            );
        }
        super::install_crypto_provider();
        let _ = rustls::ClientConfig::builder();
        assert!(rustls::crypto::CryptoProvider::get_default().is_some());
    }
}
