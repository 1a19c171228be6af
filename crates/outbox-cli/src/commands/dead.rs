//! `outbox dead list` and `outbox dead replay`: the outbox's dead letters.

use std::io::Write;

use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use outboxkit_core::{MessageFilter, OutboxAdmin};
use serde::Serialize;
use uuid::Uuid;

use super::Validated;
use crate::config::parse_window;
use crate::error::CliError;
use crate::output::{json, opt, short, table};

/// `outbox dead ...`
#[derive(Debug, Subcommand)]
pub(crate) enum DeadCommand {
    /// List dead messages (oldest first; payloads are never shown).
    List(DeadListArgs),
    /// Move dead messages back to New, visible now, attempts reset; the relay publishes
    /// them again and consumers' inboxes absorb duplicates.
    Replay(DeadReplayArgs),
}

/// Filters shared by `dead list` and `dead replay`.
#[derive(Debug, Default, Args)]
pub(crate) struct FilterArgs {
    /// Only this message id (repeatable).
    #[arg(long = "id", value_name = "UUID")]
    pub ids: Vec<uuid::Uuid>,
    /// created_at at or after (RFC 3339 time or a duration ago, e.g. 2h).
    #[arg(long, value_name = "TIME")]
    pub since: Option<String>,
    /// created_at before (RFC 3339 time or a duration ago).
    #[arg(long, value_name = "TIME")]
    pub until: Option<String>,
    /// Tenant equals.
    #[arg(long, value_name = "TENANT")]
    pub tenant: Option<String>,
    /// Aggregate type equals.
    #[arg(long, value_name = "TYPE")]
    pub aggregate_type: Option<String>,
    /// Aggregate id equals.
    #[arg(long, value_name = "ID")]
    pub aggregate_id: Option<String>,
    /// Event type equals.
    #[arg(long, value_name = "TYPE")]
    pub event_type: Option<String>,
    /// Last error contains this text (case-insensitive).
    #[arg(long, value_name = "TEXT")]
    pub error_contains: Option<String>,
}

/// `outbox dead list`
#[derive(Debug, Args)]
pub(crate) struct DeadListArgs {
    /// Which messages.
    #[command(flatten)]
    pub filter: FilterArgs,
    /// At most this many rows.
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub limit: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `outbox dead replay`
#[derive(Debug, Args)]
pub(crate) struct DeadReplayArgs {
    /// Which messages.
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Only count what would be replayed; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Replay every dead message when no filter is given (a guard against accidents).
    #[arg(long)]
    pub all: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Builds the outbox dead-letter filter from flags.
///
/// # Errors
/// [`CliError::TimeWindow`].
pub(crate) fn message_filter(
    args: &FilterArgs,
    now: DateTime<Utc>,
) -> Result<MessageFilter, CliError> {
    let (from, to) = parse_window(args.since.as_deref(), args.until.as_deref(), now)?;
    let mut f = MessageFilter::new().with_ids(args.ids.iter().copied());
    f.from = from;
    f.to = to;
    f.tenant_id = args.tenant.clone();
    f.aggregate_type = args.aggregate_type.clone();
    f.aggregate_id = args.aggregate_id.clone();
    f.event_type = args.event_type.clone();
    f.error_contains = args.error_contains.clone();
    Ok(f)
}

/// Whether a filter selects everything (replay then needs `--all`).
pub(crate) fn is_unfiltered(f: &MessageFilter) -> bool {
    *f == MessageFilter::new()
}

/// A dead outbox message as listed (never the payload).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) struct DeadView {
    /// Message id.
    pub id: Uuid,
    /// When it was written (database clock).
    pub created_at: DateTime<Utc>,
    /// Event type.
    pub event_type: String,
    /// Tenant.
    pub tenant_id: Option<String>,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
    /// Aggregate version.
    pub aggregate_version: i64,
    /// Attempts made.
    pub attempts: i32,
    /// Last error.
    pub last_error: Option<String>,
}

/// `outbox dead list`.
///
/// # Errors
/// [`CliError::Store`].
pub(crate) async fn dead_list(
    outbox: &dyn OutboxAdmin,
    filter: &MessageFilter,
    limit: usize,
) -> Result<Vec<DeadView>, CliError> {
    Ok(outbox
        .dead_letters(filter, limit)
        .await?
        .into_iter()
        .map(|m| DeadView {
            id: m.id,
            created_at: m.created_at,
            event_type: m.event_type,
            tenant_id: m.tenant_id,
            aggregate_type: m.aggregate_type,
            aggregate_id: m.aggregate_id,
            aggregate_version: m.aggregate_version,
            attempts: m.attempts,
            last_error: m.last_error,
        })
        .collect())
}

/// A replay report as printed.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[non_exhaustive]
pub(crate) struct ReplayView {
    /// Whether nothing was changed.
    pub dry_run: bool,
    /// Dead letters matching the filter.
    pub matched: u64,
    /// Made processable again.
    pub replayed: u64,
    /// Matched but not replayed.
    pub failed: u64,
    /// Wall time, seconds.
    pub elapsed_secs: f64,
}

/// `outbox dead replay`.
///
/// # Errors
/// [`CliError::Invalid`] for an unfiltered replay without `all`, [`CliError::Store`].
pub(crate) async fn dead_replay(
    outbox: &dyn OutboxAdmin,
    filter: &MessageFilter,
    dry_run: bool,
    all: bool,
) -> Result<ReplayView, CliError> {
    if is_unfiltered(filter) && !all && !dry_run {
        return Err(CliError::Invalid {
            field: "filter",
            reason: "no filter given: pass --all to replay every dead message".into(),
        });
    }
    let r = outbox.replay(filter, dry_run).await?;
    Ok(ReplayView {
        dry_run,
        matched: r.matched,
        replayed: r.replayed,
        failed: r.failed,
        elapsed_secs: r.elapsed.as_secs_f64(),
    })
}

/// `outbox dead list` with its filter built.
pub(crate) struct DeadList<'a> {
    args: &'a DeadListArgs,
    filter: MessageFilter,
}

/// Validates the arguments of `outbox dead list`: the filter's time window must parse.
pub(crate) fn validate_list(
    args: &DeadListArgs,
    now: DateTime<Utc>,
) -> Result<DeadList<'_>, CliError> {
    Ok(DeadList {
        filter: message_filter(&args.filter, now)?,
        args,
    })
}

impl Validated for DeadList<'_> {
    async fn run(self, outbox: &dyn OutboxAdmin, out: &mut dyn Write) -> Result<(), CliError> {
        let rows = dead_list(outbox, &self.filter, self.args.limit).await?;
        if self.args.json {
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
}

/// `outbox dead replay` with its filter built.
pub(crate) struct DeadReplay<'a> {
    args: &'a DeadReplayArgs,
    filter: MessageFilter,
}

/// Validates the arguments of `outbox dead replay`: the filter's time window must
/// parse. (Whether an empty filter is allowed is checked by [`dead_replay`].)
pub(crate) fn validate_replay(
    args: &DeadReplayArgs,
    now: DateTime<Utc>,
) -> Result<DeadReplay<'_>, CliError> {
    Ok(DeadReplay {
        filter: message_filter(&args.filter, now)?,
        args,
    })
}

impl Validated for DeadReplay<'_> {
    async fn run(self, outbox: &dyn OutboxAdmin, out: &mut dyn Write) -> Result<(), CliError> {
        let a = self.args;
        let report = dead_replay(outbox, &self.filter, a.dry_run, a.all).await?;
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
}
