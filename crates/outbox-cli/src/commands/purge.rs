//! `outbox purge`: deletes (or archives) sent outbox rows and inbox records older than a
//! retention, in small batches.

use std::io::Write;
use std::time::{Duration, Instant};

use clap::Args;
use outboxkit_core::OutboxAdmin;
use serde::Serialize;

use super::Validated;
use crate::config::parse_duration;
use crate::error::CliError;
use crate::output::json;

/// `outbox purge`
#[derive(Debug, Args)]
pub(crate) struct PurgeArgs {
    /// Remove sent outbox rows sent longer ago than this, and inbox records processed
    /// longer ago (e.g. 7d). Must exceed the longest redelivery or replay horizon, or
    /// late duplicates are processed again.
    #[arg(long, value_name = "DURATION")]
    pub older_than: String,
    /// Rows per statement.
    #[arg(long, default_value_t = 1000, value_name = "N")]
    pub batch_size: usize,
    /// Pause between batches, e.g. 50ms (eases load on a busy database).
    #[arg(long, default_value = "0s", value_name = "DURATION")]
    pub pause: String,
    /// Move rows to outbox_messages_archive / inbox_records_archive instead of deleting
    /// them.
    #[arg(long)]
    pub archive: bool,
    /// Leave inbox records (and processed durable-inbox messages) alone.
    #[arg(long)]
    pub outbox_only: bool,
    /// Leave the outbox alone.
    #[arg(long, conflicts_with = "outbox_only")]
    pub inbox_only: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// What `outbox purge` removed.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
#[non_exhaustive]
pub(crate) struct PurgeView {
    /// Whether rows were archived rather than deleted.
    pub archived: bool,
    /// Sent outbox rows removed.
    pub outbox_sent: u64,
    /// Inbox records removed.
    pub inbox_records: u64,
    /// Processed durable-inbox messages removed (deleted; never archived).
    pub inbox_processed: u64,
    /// Statements run.
    pub batches: u64,
    /// Wall time, seconds.
    pub elapsed_secs: f64,
}

/// What `outbox purge` should touch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PurgeScope {
    /// Sent outbox rows.
    pub outbox: bool,
    /// Inbox records and processed durable-inbox messages.
    pub inbox: bool,
}

/// `outbox purge`: removes rows older than `older_than`, `batch_size` per statement
/// (each statement skips rows locked by the relay and commits on its own), pausing
/// `pause` between statements; with `archive` moves them to the archive tables.
///
/// # Errors
/// [`CliError::Invalid`] for a zero batch size, [`CliError::Store`]; what was removed
/// before the error stays removed.
pub(crate) async fn purge(
    outbox: &dyn OutboxAdmin,
    older_than: Duration,
    batch_size: usize,
    pause: Duration,
    archive: bool,
    scope: PurgeScope,
) -> Result<PurgeView, CliError> {
    if batch_size == 0 {
        return Err(CliError::Invalid {
            field: "batch_size",
            reason: "must be at least 1".into(),
        });
    }
    let started = Instant::now();
    let mut view = PurgeView {
        archived: archive,
        ..PurgeView::default()
    };
    let full = batch_size as u64;
    if scope.outbox {
        loop {
            let n = if archive {
                outbox.archive_sent(older_than, batch_size).await?
            } else {
                outbox.purge_sent(older_than, batch_size).await?
            };
            view.batches += 1;
            view.outbox_sent += n;
            if n < full {
                break;
            }
            tokio::time::sleep(pause).await;
        }
    }
    if scope.inbox {
        loop {
            let n = if archive {
                outbox.archive_inbox_records(older_than, batch_size).await?
            } else {
                outbox.purge_inbox_records(older_than, batch_size).await?
            };
            view.batches += 1;
            view.inbox_records += n;
            if n < full {
                break;
            }
            tokio::time::sleep(pause).await;
        }
        loop {
            let n = outbox.purge_inbox_processed(older_than, batch_size).await?;
            view.batches += 1;
            view.inbox_processed += n;
            if n < full {
                break;
            }
            tokio::time::sleep(pause).await;
        }
    }
    view.elapsed_secs = started.elapsed().as_secs_f64();
    Ok(view)
}

/// `outbox purge` with its durations parsed.
pub(crate) struct Purge<'a> {
    args: &'a PurgeArgs,
    older_than: Duration,
    pause: Duration,
}

/// Validates the arguments of `outbox purge`: `--older-than` and `--pause` must be
/// durations. (A zero `--batch-size` is rejected by [`purge`].)
pub(crate) fn validate(args: &PurgeArgs) -> Result<Purge<'_>, CliError> {
    Ok(Purge {
        older_than: parse_duration("older_than", &args.older_than)?,
        pause: parse_duration("pause", &args.pause)?,
        args,
    })
}

impl Validated for Purge<'_> {
    async fn run(self, outbox: &dyn OutboxAdmin, out: &mut dyn Write) -> Result<(), CliError> {
        let a = self.args;
        let scope = PurgeScope {
            outbox: !a.inbox_only,
            inbox: !a.outbox_only,
        };
        let report = purge(
            outbox,
            self.older_than,
            a.batch_size,
            self.pause,
            a.archive,
            scope,
        )
        .await?;
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
}
