//! # outbox-cli
//!
//! The `outbox` operations binary, usable as a library (the binary is a thin
//! `main.rs` over [`main_with_args`]):
//!
//! - `outbox relay`: the [`Dispatcher`](outbox_core::Dispatcher) over PostgreSQL or SQL
//!   Server and RabbitMQ or NATS, configured by flags, environment variables and a TOML file
//!   ([`config`]); serves `/metrics` (Prometheus) and `/healthz` ([`health`]); text or
//!   JSON logs; graceful shutdown on SIGINT/SIGTERM ([`relay::Relay`]);
//! - `outbox migrate`, `outbox stats`, `outbox reconcile`;
//! - `outbox dead list|replay`, `outbox inbox dead list|replay`;
//! - `outbox purge` (delete or archive, in small batches).
//!
//! The database is chosen by the URL ([`database`]: `postgres://`, `sqlserver://`,
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
//! use outbox_cli::Cli;
//!
//! # async fn demo() -> Result<(), outbox_cli::CliError> {
//! let cli = Cli::parse_from(["outbox", "--database-url", "postgres://postgres@127.0.0.1/app", "stats", "--json"]);
//! outbox_cli::run(cli, &mut std::io::stdout()).await?;
//! # Ok(()) }
//! ```

#[cfg(not(any(feature = "postgres", feature = "sqlserver")))]
compile_error!("outbox-cli needs a database feature: `postgres` and/or `sqlserver`");
#[cfg(not(any(feature = "rabbit", feature = "nats")))]
compile_error!("outbox-cli needs a transport feature: `rabbit` and/or `nats`");

pub mod cli;
pub mod commands;
pub mod config;
pub mod database;
pub mod error;
pub mod health;
mod output;
pub mod relay;

use std::io::Write;
use std::process::ExitCode;

use chrono::Utc;
use clap::Parser as _;
use outbox_core::OutboxAdmin;
use tokio_util::sync::CancellationToken;

pub use cli::Cli;
pub use error::CliError;

use crate::cli::{Command, DeadCommand, InboxCommand, InboxDeadCommand, LogFormat};
use crate::config::{DbSettings, FileConfig, RelaySettings, parse_duration};
use crate::output::{json, opt, secs, short, table};

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
pub fn install_crypto_provider() {
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
pub fn init_logging(format: LogFormat) {
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
    if let Command::Relay(args) = &cli.command {
        let settings = RelaySettings::resolve(&cli, args, &file)?;
        let shutdown = CancellationToken::new();
        let relay = relay::Relay::start(&settings, shutdown.clone()).await?;
        tokio::spawn(relay::cancel_on_signal(shutdown));
        relay.wait().await?;
        return Ok(());
    }
    let db = DbSettings::resolve(&cli, &file)?;
    let now = Utc::now();
    // Validate the command's input before connecting.
    let prepared = prepare(&cli.command, now)?;
    let outbox = database::connect_admin(&db.url, &db.schema).await?;
    execute(&cli.command, prepared, &*outbox, out).await
}

/// Parsed arguments of a command (filters, durations), validated up front.
enum Prepared {
    None,
    Filter(outbox_core::MessageFilter),
    InboxFilter(outbox_core::InboxDeadFilter),
    Purge {
        older_than: std::time::Duration,
        pause: std::time::Duration,
    },
}

fn prepare(command: &Command, now: chrono::DateTime<Utc>) -> Result<Prepared, CliError> {
    Ok(match command {
        Command::Dead {
            command: DeadCommand::List(a),
        } => Prepared::Filter(commands::message_filter(&a.filter, now)?),
        Command::Dead {
            command: DeadCommand::Replay(a),
        } => Prepared::Filter(commands::message_filter(&a.filter, now)?),
        Command::Inbox {
            command:
                InboxCommand::Dead {
                    command: InboxDeadCommand::List(a),
                },
        } => Prepared::InboxFilter(commands::inbox_filter(&a.filter, now)?),
        Command::Inbox {
            command:
                InboxCommand::Dead {
                    command: InboxDeadCommand::Replay(a),
                },
        } => Prepared::InboxFilter(commands::inbox_filter(&a.filter, now)?),
        Command::Purge(a) => Prepared::Purge {
            older_than: parse_duration("older_than", &a.older_than)?,
            pause: parse_duration("pause", &a.pause)?,
        },
        Command::Reconcile(a) => {
            config::parse_window(a.since.as_deref(), a.until.as_deref(), now)?;
            Prepared::None
        }
        _ => Prepared::None,
    })
}

async fn execute(
    command: &Command,
    prepared: Prepared,
    outbox: &dyn OutboxAdmin,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    match (command, prepared) {
        (Command::Relay(_), _) => Ok(()),
        (Command::Migrate, _) => {
            let applied = outbox.migrate().await?;
            if applied.is_empty() {
                writeln!(out, "schema {} is up to date", outbox.schema())?;
            } else {
                writeln!(
                    out,
                    "schema {}: applied migrations {applied:?}",
                    outbox.schema()
                )?;
            }
            Ok(())
        }
        (Command::Stats(a), _) => {
            let report = commands::stats(outbox, a.blocked_limit).await?;
            if a.json {
                return json(out, &report);
            }
            print_stats(out, &report)
        }
        (Command::Reconcile(a), _) => {
            let rows = commands::reconcile(
                outbox,
                a.since.as_deref(),
                a.until.as_deref(),
                &a.consumers,
                a.only_differences,
            )
            .await?;
            if a.json {
                return json(out, &rows);
            }
            let cells: Vec<Vec<String>> = rows
                .iter()
                .map(|r| {
                    vec![
                        r.day.to_string(),
                        opt(r.tenant_id.as_deref()),
                        r.event_type.clone(),
                        r.consumer.clone(),
                        r.written.to_string(),
                        r.processed.to_string(),
                        r.dead.to_string(),
                        r.missing.to_string(),
                    ]
                })
                .collect();
            table(
                out,
                &[
                    "DAY",
                    "TENANT",
                    "EVENT TYPE",
                    "CONSUMER",
                    "WRITTEN",
                    "PROCESSED",
                    "DEAD",
                    "MISSING",
                ],
                &cells,
            )?;
            let missing: i64 = rows.iter().map(|r| r.missing).sum();
            writeln!(out, "total difference: {missing}")?;
            Ok(())
        }
        (
            Command::Dead {
                command: DeadCommand::List(a),
            },
            Prepared::Filter(filter),
        ) => {
            let rows = commands::dead_list(outbox, &filter, a.limit).await?;
            if a.json {
                return json(out, &rows);
            }
            let cells: Vec<Vec<String>> = rows
                .iter()
                .map(|m| {
                    vec![
                        m.id.to_string(),
                        m.created_at.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
                        m.event_type.clone(),
                        opt(m.tenant_id.as_deref()),
                        format!(
                            "{}/{}@{}",
                            m.aggregate_type, m.aggregate_id, m.aggregate_version
                        ),
                        m.attempts.to_string(),
                        short(m.last_error.as_deref(), 80),
                    ]
                })
                .collect();
            table(
                out,
                &[
                    "ID",
                    "CREATED",
                    "EVENT TYPE",
                    "TENANT",
                    "AGGREGATE",
                    "ATTEMPTS",
                    "LAST ERROR",
                ],
                &cells,
            )
        }
        (
            Command::Dead {
                command: DeadCommand::Replay(a),
            },
            Prepared::Filter(filter),
        ) => {
            let report = commands::dead_replay(outbox, &filter, a.dry_run, a.all).await?;
            if a.json {
                return json(out, &report);
            }
            writeln!(
                out,
                "{}matched {}, replayed {}, failed {}, elapsed {:.3}s",
                if a.dry_run { "dry run: " } else { "" },
                report.matched,
                report.replayed,
                report.failed,
                report.elapsed_secs
            )?;
            Ok(())
        }
        (
            Command::Inbox {
                command:
                    InboxCommand::Dead {
                        command: InboxDeadCommand::List(a),
                    },
            },
            Prepared::InboxFilter(filter),
        ) => {
            let rows = commands::inbox_dead_list(outbox, &filter, a.limit).await?;
            if a.json {
                return json(out, &rows);
            }
            let cells: Vec<Vec<String>> = rows
                .iter()
                .map(|d| {
                    vec![
                        format!("{:?}", d.kind).to_lowercase(),
                        d.message_id.to_string(),
                        opt(d.consumer.as_deref()),
                        d.event_type.clone(),
                        d.attempts.to_string(),
                        d.at.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
                        short(d.last_error.as_deref(), 80),
                    ]
                })
                .collect();
            table(
                out,
                &[
                    "KIND",
                    "MESSAGE ID",
                    "CONSUMER",
                    "EVENT TYPE",
                    "ATTEMPTS",
                    "AT",
                    "LAST ERROR",
                ],
                &cells,
            )
        }
        (
            Command::Inbox {
                command:
                    InboxCommand::Dead {
                        command: InboxDeadCommand::Replay(a),
                    },
            },
            Prepared::InboxFilter(filter),
        ) => {
            let report =
                commands::inbox_dead_replay(outbox, &filter, a.dry_run, a.all, a.clear_only)
                    .await?;
            if a.json {
                return json(out, &report);
            }
            writeln!(
                out,
                "{}matched {}, replayed {}, failed {}, elapsed {:.3}s",
                if a.dry_run { "dry run: " } else { "" },
                report.matched,
                report.replayed,
                report.failed,
                report.elapsed_secs
            )?;
            Ok(())
        }
        (Command::Purge(a), Prepared::Purge { older_than, pause }) => {
            let scope = commands::PurgeScope {
                outbox: !a.inbox_only,
                inbox: !a.outbox_only,
            };
            let report =
                commands::purge(outbox, older_than, a.batch_size, pause, a.archive, scope).await?;
            if a.json {
                return json(out, &report);
            }
            writeln!(
                out,
                "{} {} sent outbox rows, {} inbox records; deleted {} processed durable-inbox messages; {} statements in {:.3}s",
                if report.archived {
                    "archived"
                } else {
                    "deleted"
                },
                report.outbox_sent,
                report.inbox_records,
                report.inbox_processed,
                report.batches,
                report.elapsed_secs
            )?;
            Ok(())
        }
        (_, _) => Err(CliError::Task("arguments were not prepared".into())),
    }
}

fn print_stats(out: &mut dyn Write, r: &commands::StatsReport) -> Result<(), CliError> {
    let t = &r.totals;
    writeln!(
        out,
        "new {}  processing {}  sent {}  dead {}  oldest pending {}",
        t.new,
        t.processing,
        t.sent,
        t.dead,
        secs(t.oldest_pending_age_secs)
    )?;
    writeln!(out)?;
    let cells: Vec<Vec<String>> = r
        .groups
        .iter()
        .map(|g| {
            vec![
                g.event_type.clone(),
                opt(g.tenant_id.as_deref()),
                g.new.to_string(),
                g.processing.to_string(),
                g.sent.to_string(),
                g.dead.to_string(),
                secs(g.oldest_pending_age_secs),
            ]
        })
        .collect();
    table(
        out,
        &[
            "EVENT TYPE",
            "TENANT",
            "NEW",
            "PROCESSING",
            "SENT",
            "DEAD",
            "OLDEST PENDING",
        ],
        &cells,
    )?;
    if !r.blocked_keys.is_empty() {
        writeln!(out)?;
        writeln!(out, "blocked keys (ordered mode):")?;
        let cells: Vec<Vec<String>> = r
            .blocked_keys
            .iter()
            .map(|k| {
                vec![
                    k.key.clone(),
                    k.head_id.to_string(),
                    k.status.clone(),
                    k.attempts.to_string(),
                    k.waiting.to_string(),
                    opt(k.blocked_since.map(|t| t.format("%Y-%m-%dT%H:%M:%SZ"))),
                    short(k.last_error.as_deref(), 60),
                ]
            })
            .collect();
        table(
            out,
            &[
                "KEY",
                "HEAD",
                "STATUS",
                "ATTEMPTS",
                "WAITING",
                "SINCE",
                "LAST ERROR",
            ],
            &cells,
        )?;
    }
    Ok(())
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
