//! `outbox wal setup|status|drop`: the logical replication slot and publication that
//! `outbox relay --source wal` reads (PostgreSQL only; docs/wal.md).

use std::io::Write;

use clap::{Args, Subcommand};

use crate::config::DbSettings;
use crate::error::CliError;

/// The names of the slot and the publication (`--slot`, `--publication`).
#[derive(Debug, Default, Clone, Args)]
pub struct WalArgs {
    /// --source wal: the logical replication slot [default: {schema}_outbox].
    #[arg(long, env = "OUTBOX_WAL_SLOT", value_name = "NAME")]
    pub slot: Option<String>,

    /// --source wal: the publication on the outbox table [default: {schema}_outbox].
    #[arg(long, env = "OUTBOX_WAL_PUBLICATION", value_name = "NAME")]
    pub publication: Option<String>,
}

/// `outbox wal ...`
#[derive(Debug, Subcommand)]
pub(crate) enum WalCommand {
    /// Create the publication and the slot (each only if missing) and disable the
    /// polling relay's NOTIFY trigger. Needs wal_level = logical. An existing
    /// publication must cover the outbox table's inserts and updates (it is checked,
    /// never changed); an invalidated slot, or a slot without its publication, is
    /// refused (see docs/wal.md, Starting over).
    Setup {
        /// Slot and publication names.
        #[command(flatten)]
        wal: WalArgs,
        /// Create a failover slot, copied to standbys with sync_replication_slots = on
        /// (PostgreSQL 17 or later; refused before 17, and for a slot that exists
        /// without it). See docs/wal.md, Failover.
        #[arg(long)]
        failover: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show the slot (active reader, confirmed position, WAL retained) and the
    /// publication.
    Status {
        /// Slot and publication names.
        #[command(flatten)]
        wal: WalArgs,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Drop the slot and the publication and enable the NOTIFY trigger again (go back
    /// to polling). A slot being read is refused unless --force, which ends the
    /// reading relay's session (that relay then stops with "slot does not exist").
    Drop {
        /// Slot and publication names.
        #[command(flatten)]
        wal: WalArgs,
        /// Also when a relay reads the slot.
        #[arg(long)]
        force: bool,
    },
}

#[cfg(feature = "postgres")]
/// The checked [`WalConfig`](outboxkit_postgres::wal::WalConfig) of `schema` with the
/// names given.
pub(crate) fn wal_config(
    schema: &str,
    slot: Option<&str>,
    publication: Option<&str>,
) -> Result<outboxkit_postgres::wal::WalConfig, CliError> {
    let mut wal = outboxkit_postgres::wal::WalConfig::new(schema);
    if let Some(slot) = slot {
        wal = wal.with_slot(slot);
    }
    if let Some(publication) = publication {
        wal = wal.with_publication(publication);
    }
    wal.validate().map_err(|e| CliError::Invalid {
        field: "wal",
        reason: e.to_string(),
    })?;
    Ok(wal)
}

#[cfg(feature = "postgres")]
/// Runs `command` against the database of `db` (which must be PostgreSQL).
pub(crate) async fn run(
    db: &DbSettings,
    command: &WalCommand,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let (WalCommand::Setup { wal, .. }
    | WalCommand::Status { wal, .. }
    | WalCommand::Drop { wal, .. }) = command;
    if db.kind()? != crate::database::DatabaseKind::Postgres {
        return Err(CliError::Invalid {
            field: "database_url",
            reason: "`outbox wal` manages a PostgreSQL replication slot: use a postgres:// URL"
                .into(),
        });
    }
    let mut config = wal_config(&db.schema, wal.slot.as_deref(), wal.publication.as_deref())?;
    if let WalCommand::Setup { failover, .. } = command {
        config = config.with_failover(*failover);
    }
    let outbox =
        outboxkit_postgres::PgOutbox::connect(&db.pg_config().with_max_connections(2)).await?;
    match command {
        WalCommand::Setup { json, .. } => {
            let report = outboxkit_postgres::wal::setup(&outbox, &config).await?;
            if *json {
                writeln!(
                    out,
                    "{}",
                    serde_json::to_string_pretty(&report).unwrap_or_default()
                )?;
            } else {
                let done = |created: bool| if created { "created" } else { "exists" };
                writeln!(
                    out,
                    "publication {}: {}",
                    config.publication(),
                    done(report.publication_created)
                )?;
                writeln!(
                    out,
                    "slot {}: {}{}",
                    config.slot(),
                    done(report.slot_created),
                    if report.failover == Some(true) {
                        " (failover)"
                    } else {
                        ""
                    }
                )?;
                if report.notify_trigger_disabled {
                    writeln!(
                        out,
                        "NOTIFY trigger on {}.outbox_messages: disabled",
                        db.schema
                    )?;
                }
                if report.pending_in_table > 0 {
                    writeln!(
                        out,
                        "warning: {} messages are pending in the table; those committed before the slot was created are not in it: let the polling relay send them (`outbox relay`) until `outbox stats` shows none pending, then start `outbox relay --source wal`",
                        report.pending_in_table
                    )?;
                }
            }
        }
        WalCommand::Status { json, .. } => {
            let s = outboxkit_postgres::wal::status(&outbox, &config).await?;
            if *json {
                writeln!(
                    out,
                    "{}",
                    serde_json::to_string_pretty(&s).unwrap_or_default()
                )?;
            } else {
                let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
                writeln!(out, "wal_level:            {}", s.wal_level)?;
                writeln!(
                    out,
                    "slot:                 {} ({})",
                    s.slot,
                    if s.slot_exists { "exists" } else { "missing" }
                )?;
                writeln!(
                    out,
                    "active reader pid:    {}",
                    or_dash(s.active_pid.map(|p| p.to_string()))
                )?;
                writeln!(
                    out,
                    "confirmed position:   {}",
                    or_dash(s.confirmed_flush_lsn.clone())
                )?;
                writeln!(
                    out,
                    "WAL retained (bytes): {}",
                    or_dash(s.retained_bytes.map(|b| b.to_string()))
                )?;
                writeln!(
                    out,
                    "wal_status:           {}",
                    or_dash(s.wal_status.clone())
                )?;
                writeln!(
                    out,
                    "failover slot:        {}",
                    match s.failover {
                        Some(true) => "yes",
                        Some(false) => "no",
                        None => "-",
                    }
                )?;
                writeln!(
                    out,
                    "publication:          {} ({})",
                    s.publication,
                    match (&s.publication_gap, s.publication_exists) {
                        (Some(gap), _) => format!("incomplete: {gap}"),
                        (None, true) => "exists".to_owned(),
                        (None, false) => "missing".to_owned(),
                    }
                )?;
                writeln!(
                    out,
                    "NOTIFY trigger:       {}",
                    match s.notify_trigger_enabled {
                        Some(true) => "enabled",
                        Some(false) => "disabled",
                        None => "-",
                    }
                )?;
            }
        }
        WalCommand::Drop { force, .. } => {
            let existed = outboxkit_postgres::wal::drop_slot(&outbox, &config, *force).await?;
            writeln!(
                out,
                "slot {}: {}; publication {} dropped; NOTIFY trigger enabled",
                config.slot(),
                if existed { "dropped" } else { "did not exist" },
                config.publication()
            )?;
        }
    }
    Ok(())
}

/// Without PostgreSQL compiled in there is no slot to manage.
#[cfg(not(feature = "postgres"))]
pub(crate) async fn run(
    _db: &DbSettings,
    _command: &WalCommand,
    _out: &mut dyn Write,
) -> Result<(), CliError> {
    Err(CliError::FeatureMissing {
        backend: "PostgreSQL",
        feature: "postgres",
    })
}
