//! The admin commands as library functions: each returns a serializable report, and
//! [`crate::run`] prints it as a table or JSON.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use outbox_core::{
    GroupStats, InboxDeadFilter, InboxDeadLetter, InboxReplayReport, MessageFilter, OutboxAdmin,
    ReconcileRow,
};
use serde::Serialize;
use uuid::Uuid;

use crate::cli::{FilterArgs, InboxFilterArgs};
use crate::config::parse_window;
use crate::error::CliError;

/// `outbox stats`: totals, per group and blocked keys.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[non_exhaustive]
pub struct StatsReport {
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
pub struct Totals {
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
pub struct BlockedKeyView {
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
pub async fn stats(
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

/// Gathers `outbox reconcile` for `[since, until)` (defaults: 7 days ago, now).
///
/// # Errors
/// [`CliError::TimeWindow`], [`CliError::Store`].
pub async fn reconcile(
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

/// Builds the outbox dead-letter filter from flags.
///
/// # Errors
/// [`CliError::TimeWindow`].
pub fn message_filter(args: &FilterArgs, now: DateTime<Utc>) -> Result<MessageFilter, CliError> {
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

/// Builds the consumer dead-letter filter from flags.
///
/// # Errors
/// [`CliError::TimeWindow`].
pub fn inbox_filter(
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

/// Whether a filter selects everything (replay then needs `--all`).
pub fn is_unfiltered(f: &MessageFilter) -> bool {
    *f == MessageFilter::new()
}

/// A dead outbox message as listed (never the payload).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadView {
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
pub async fn dead_list(
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
pub struct ReplayView {
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
pub async fn dead_replay(
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

/// `outbox inbox dead list`.
///
/// # Errors
/// [`CliError::Store`].
pub async fn inbox_dead_list(
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
pub async fn inbox_dead_replay(
    outbox: &dyn OutboxAdmin,
    filter: &InboxDeadFilter,
    dry_run: bool,
    all: bool,
    clear_only: bool,
) -> Result<InboxReplayReport, CliError> {
    if *filter == InboxDeadFilter::new() && !all && !dry_run {
        return Err(CliError::Invalid {
            field: "filter",
            reason: "no filter given: pass --all to replay every consumer dead letter".into(),
        });
    }
    Ok(outbox
        .replay_inbox_dead_letters(filter, dry_run, clear_only)
        .await?)
}

/// What `outbox purge` removed.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
#[non_exhaustive]
pub struct PurgeView {
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
#[non_exhaustive]
pub struct PurgeScope {
    /// Sent outbox rows.
    pub outbox: bool,
    /// Inbox records and processed durable-inbox messages.
    pub inbox: bool,
}

impl PurgeScope {
    /// Both.
    pub fn all() -> Self {
        Self {
            outbox: true,
            inbox: true,
        }
    }
}

/// `outbox purge`: removes rows older than `older_than`, `batch_size` per statement
/// (each statement skips rows locked by the relay and commits on its own), pausing
/// `pause` between statements; with `archive` moves them to the archive tables.
///
/// # Errors
/// [`CliError::Invalid`] for a zero batch size, [`CliError::Store`]; what was removed
/// before the error stays removed.
pub async fn purge(
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
