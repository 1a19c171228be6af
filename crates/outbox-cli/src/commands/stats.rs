//! `outbox stats`: counts by status, per event type and tenant, and blocked keys.

use std::io::Write;

use chrono::{DateTime, Utc};
use clap::Args;
use outboxkit_core::{GroupStats, OutboxAdmin};
use serde::Serialize;
use uuid::Uuid;

use super::Validated;
use crate::error::CliError;
use crate::output::{json, opt, secs, short, table};

/// `outbox stats`
#[derive(Debug, Args)]
pub(crate) struct StatsArgs {
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// At most this many blocked keys.
    #[arg(long, default_value_t = 20, value_name = "N")]
    pub blocked_limit: usize,
}

/// `outbox stats`: totals, per group and blocked keys.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[non_exhaustive]
pub(crate) struct StatsReport {
    /// Whole-table counts.
    pub totals: Totals,
    /// Per event type and tenant.
    pub groups: Vec<GroupStats>,
    /// Keys held back in ordered mode (head dead or in backoff), longest first.
    pub blocked_keys: Vec<BlockedKeyView>,
}

/// Whole-table counts.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[non_exhaustive]
pub(crate) struct Totals {
    /// New.
    pub new: u64,
    /// Processing.
    pub processing: u64,
    /// Sent (not yet purged).
    pub sent: u64,
    /// Dead.
    pub dead: u64,
    /// Age of the oldest New/Processing row, seconds.
    pub oldest_pending_age_secs: Option<f64>,
}

/// A blocked key as printed.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) struct BlockedKeyView {
    /// The key (store encoding).
    pub key: String,
    /// Head message id.
    pub head_id: Uuid,
    /// Head status (`New` in backoff, or `Dead`).
    pub status: String,
    /// Head attempts.
    pub attempts: i32,
    /// Head last error.
    pub last_error: Option<String>,
    /// Since when the key waits.
    pub blocked_since: Option<DateTime<Utc>>,
    /// When a New head is retried.
    pub retry_at: Option<DateTime<Utc>>,
    /// Messages waiting behind the head.
    pub waiting: u64,
}

/// Gathers `outbox stats`.
///
/// # Errors
/// [`CliError::Store`].
pub(crate) async fn stats(
    outbox: &dyn OutboxAdmin,
    blocked_limit: usize,
) -> Result<StatsReport, CliError> {
    let t = outbox.stats().await?;
    let groups = outbox.stats_by_group().await?;
    let blocked_keys = outbox
        .blocked_keys(blocked_limit)
        .await?
        .into_iter()
        .map(|k| BlockedKeyView {
            key: k.key,
            head_id: k.head_id,
            status: format!("{:?}", k.status),
            attempts: k.attempts,
            last_error: k.last_error,
            blocked_since: k.blocked_since,
            retry_at: k.retry_at,
            waiting: k.waiting,
        })
        .collect();
    Ok(StatsReport {
        totals: Totals {
            new: t.new,
            processing: t.processing,
            sent: t.sent,
            dead: t.dead,
            oldest_pending_age_secs: t.oldest_pending_age.map(|d| d.as_secs_f64()),
        },
        groups,
        blocked_keys,
    })
}

/// `outbox stats`, ready to run (it has nothing to validate).
pub(crate) struct Stats<'a>(&'a StatsArgs);

/// Validates the arguments of `outbox stats`.
pub(crate) fn validate(args: &StatsArgs) -> Result<Stats<'_>, CliError> {
    Ok(Stats(args))
}

impl Validated for Stats<'_> {
    async fn run(self, outbox: &dyn OutboxAdmin, out: &mut dyn Write) -> Result<(), CliError> {
        let report = stats(outbox, self.0.blocked_limit).await?;
        if self.0.json {
            return json(out, &report);
        }
        render(out, &report)
    }
}

fn render(out: &mut dyn Write, r: &StatsReport) -> Result<(), CliError> {
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
