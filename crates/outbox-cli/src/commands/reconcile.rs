//! `outbox reconcile`: messages written vs processed per day, tenant, event type and
//! consumer.

use std::io::Write;

use chrono::{DateTime, Utc};
use clap::Args;
use outboxkit_core::{OutboxAdmin, ReconcileRow};

use super::Validated;
use crate::config::parse_window;
use crate::error::CliError;
use crate::output::{json, opt, table};

/// `outbox reconcile`
#[derive(Debug, Args)]
pub(crate) struct ReconcileArgs {
    /// Start of the window (RFC 3339 time, or a duration meaning that long ago, e.g.
    /// 7d) [default: 7d].
    #[arg(long, value_name = "TIME")]
    pub since: Option<String>,
    /// End of the window, exclusive (RFC 3339 time or duration ago) [default: now].
    #[arg(long, value_name = "TIME")]
    pub until: Option<String>,
    /// Consumer expected to process every event type in the window (repeatable); also
    /// restricts the output to the named consumers.
    #[arg(long = "consumer", value_name = "NAME")]
    pub consumers: Vec<String>,
    /// Show only lines with a difference.
    #[arg(long)]
    pub only_differences: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Gathers `outbox reconcile` for `[since, until)` (defaults: 7 days ago, now).
///
/// # Errors
/// [`CliError::TimeWindow`], [`CliError::Store`].
pub(crate) async fn reconcile(
    outbox: &dyn OutboxAdmin,
    since: Option<&str>,
    until: Option<&str>,
    consumers: &[String],
    only_differences: bool,
) -> Result<Vec<ReconcileRow>, CliError> {
    let now = Utc::now();
    let (from, to) = parse_window(since.or(Some("7d")), until, now)?;
    let from = from.unwrap_or(now);
    let to = to.unwrap_or(now + chrono::Duration::seconds(1));
    if from >= to {
        return Err(CliError::TimeWindow {
            reason: format!("--since ({from}) must be before --until ({to})"),
        });
    }
    let mut rows = outbox.reconcile(from, to, consumers).await?;
    if only_differences {
        rows.retain(|r| r.missing != 0);
    }
    Ok(rows)
}

/// `outbox reconcile` with a well-formed window.
pub(crate) struct Reconcile<'a>(&'a ReconcileArgs);

/// Validates the arguments of `outbox reconcile`: `--since` and `--until` must parse.
pub(crate) fn validate(
    args: &ReconcileArgs,
    now: DateTime<Utc>,
) -> Result<Reconcile<'_>, CliError> {
    parse_window(args.since.as_deref(), args.until.as_deref(), now)?;
    Ok(Reconcile(args))
}

impl Validated for Reconcile<'_> {
    async fn run(self, outbox: &dyn OutboxAdmin, out: &mut dyn Write) -> Result<(), CliError> {
        let a = self.0;
        let rows = reconcile(
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
        render(out, &rows)
    }
}

fn render(out: &mut dyn Write, rows: &[ReconcileRow]) -> Result<(), CliError> {
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
