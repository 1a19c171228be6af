//! `outbox inbox dead list` and `outbox inbox dead replay`: consumer dead letters
//! (idempotent-consumer failure records and durable-inbox Dead rows).

use std::io::Write;

use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use outboxkit_core::{
    InboxDeadFilter, InboxDeadLetter, InboxReplayMode, InboxReplayReport, OutboxAdmin,
};

use super::Validated;
use crate::config::parse_window;
use crate::error::CliError;
use crate::output::{json, opt, short, table};

/// `outbox inbox dead ...`
#[derive(Debug, Subcommand)]
pub(crate) enum InboxDeadCommand {
    /// List consumer dead letters (idempotent-consumer failures and durable-inbox Dead
    /// rows).
    List(InboxDeadListArgs),
    /// Make consumer dead letters processable again: durable-inbox rows go back to
    /// New; for idempotent consumers the failure record is cleared and the message's
    /// outbox row is set back to New so the relay delivers it again.
    Replay(InboxDeadReplayArgs),
}

/// Filters of consumer dead letters.
#[derive(Debug, Default, Args)]
pub(crate) struct InboxFilterArgs {
    /// Only this message id (repeatable).
    #[arg(long = "id", value_name = "UUID")]
    pub ids: Vec<uuid::Uuid>,
    /// Dead at or after (durable inbox: received at or after); RFC 3339 or a duration ago.
    #[arg(long, value_name = "TIME")]
    pub since: Option<String>,
    /// Dead before (durable inbox: received before); RFC 3339 or a duration ago.
    #[arg(long, value_name = "TIME")]
    pub until: Option<String>,
    /// Consumer (handler) name equals.
    #[arg(long, value_name = "NAME")]
    pub consumer: Option<String>,
    /// Event type equals.
    #[arg(long, value_name = "TYPE")]
    pub event_type: Option<String>,
    /// Last error contains this text (case-insensitive).
    #[arg(long, value_name = "TEXT")]
    pub error_contains: Option<String>,
}

/// `outbox inbox dead list`
#[derive(Debug, Args)]
pub(crate) struct InboxDeadListArgs {
    /// Which dead letters.
    #[command(flatten)]
    pub filter: InboxFilterArgs,
    /// At most this many rows.
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub limit: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// `outbox inbox dead replay`
#[derive(Debug, Args)]
pub(crate) struct InboxDeadReplayArgs {
    /// Which dead letters.
    #[command(flatten)]
    pub filter: InboxFilterArgs,
    /// Only count what would be replayed; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Replay every consumer dead letter when no filter is given.
    #[arg(long)]
    pub all: bool,
    /// Idempotent consumers: only delete the failure records, do not requeue the
    /// outbox rows (when the messages come from another database, redeliver them
    /// yourself).
    #[arg(long)]
    pub clear_only: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

impl InboxDeadReplayArgs {
    /// The replay mode the flags ask for: `--dry-run` wins over `--clear-only`.
    pub(crate) fn mode(&self) -> InboxReplayMode {
        if self.dry_run {
            InboxReplayMode::DryRun
        } else if self.clear_only {
            InboxReplayMode::ClearOnly
        } else {
            InboxReplayMode::Republish
        }
    }
}

/// Builds the consumer dead-letter filter from flags.
///
/// # Errors
/// [`CliError::TimeWindow`].
pub(crate) fn inbox_filter(
    args: &InboxFilterArgs,
    now: DateTime<Utc>,
) -> Result<InboxDeadFilter, CliError> {
    let (from, to) = parse_window(args.since.as_deref(), args.until.as_deref(), now)?;
    let mut f = InboxDeadFilter::new();
    f.ids = args.ids.clone();
    f.from = from;
    f.to = to;
    f.consumer = args.consumer.clone();
    f.event_type = args.event_type.clone();
    f.error_contains = args.error_contains.clone();
    Ok(f)
}

/// `outbox inbox dead list`.
///
/// # Errors
/// [`CliError::Store`].
pub(crate) async fn inbox_dead_list(
    outbox: &dyn OutboxAdmin,
    filter: &InboxDeadFilter,
    limit: usize,
) -> Result<Vec<InboxDeadLetter>, CliError> {
    Ok(outbox.inbox_dead_letters(filter, limit).await?)
}

/// `outbox inbox dead replay`.
///
/// # Errors
/// [`CliError::Invalid`] for an unfiltered replay without `all`, [`CliError::Store`].
pub(crate) async fn inbox_dead_replay(
    outbox: &dyn OutboxAdmin,
    filter: &InboxDeadFilter,
    mode: InboxReplayMode,
    all: bool,
) -> Result<InboxReplayReport, CliError> {
    if *filter == InboxDeadFilter::new() && !all && mode != InboxReplayMode::DryRun {
        return Err(CliError::Invalid {
            field: "filter",
            reason: "no filter given: pass --all to replay every consumer dead letter".into(),
        });
    }
    Ok(outbox.replay_inbox_dead_letters(filter, mode).await?)
}

/// `outbox inbox dead list` with its filter built.
pub(crate) struct InboxDeadList<'a> {
    args: &'a InboxDeadListArgs,
    filter: InboxDeadFilter,
}

/// Validates the arguments of `outbox inbox dead list`: the filter's time window must
/// parse.
pub(crate) fn validate_list(
    args: &InboxDeadListArgs,
    now: DateTime<Utc>,
) -> Result<InboxDeadList<'_>, CliError> {
    Ok(InboxDeadList {
        filter: inbox_filter(&args.filter, now)?,
        args,
    })
}

impl Validated for InboxDeadList<'_> {
    async fn run(self, outbox: &dyn OutboxAdmin, out: &mut dyn Write) -> Result<(), CliError> {
        let rows = inbox_dead_list(outbox, &self.filter, self.args.limit).await?;
        if self.args.json {
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
}

/// `outbox inbox dead replay` with its filter built.
pub(crate) struct InboxDeadReplay<'a> {
    args: &'a InboxDeadReplayArgs,
    filter: InboxDeadFilter,
}

/// Validates the arguments of `outbox inbox dead replay`: the filter's time window
/// must parse. (Whether an empty filter is allowed is checked by
/// [`inbox_dead_replay`].)
pub(crate) fn validate_replay(
    args: &InboxDeadReplayArgs,
    now: DateTime<Utc>,
) -> Result<InboxDeadReplay<'_>, CliError> {
    Ok(InboxDeadReplay {
        filter: inbox_filter(&args.filter, now)?,
        args,
    })
}

impl Validated for InboxDeadReplay<'_> {
    async fn run(self, outbox: &dyn OutboxAdmin, out: &mut dyn Write) -> Result<(), CliError> {
        let a = self.args;
        let report = inbox_dead_replay(outbox, &self.filter, a.mode(), a.all).await?;
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
