//! Database selection for the demo: PostgreSQL (default) or MySQL / MariaDB
//! (`--database postgres|mysql`). Everything database-specific lives here (the business
//! tables, the order's transaction, the projection's upsert, the reconciliation's
//! latency query); the producers, the relay, the consumer and the reconciliation are the
//! same for both.

mod mysql;
mod postgres;

pub(crate) use mysql::MySql;
pub(crate) use postgres::Postgres;

use outboxkit_core::async_trait;
use outboxkit_core::{ConsumerDeadLetters, InboxStore, NewMessage, OutboxStore, VersionTracking};

use crate::OrderPlaced;

/// The database picked by `--database`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum DatabaseKind {
    /// PostgreSQL (`outboxkit-postgres`).
    Postgres,
    /// MySQL 8.0+ or MariaDB 10.6+ (`outboxkit-mysql`).
    Mysql,
}

/// A projection row as the consumer writes it.
pub(crate) struct Projection<'a> {
    pub(crate) order: &'a OrderPlaced,
    pub(crate) event_id: uuid::Uuid,
    /// The trace id of the delivered `traceparent` header.
    pub(crate) delivered_trace_id: Option<String>,
    /// The trace id of the handler's own span.
    pub(crate) handler_trace_id: Option<String>,
}

/// One backend of the demo: its outbox and inbox, in the demo's schema, next to the
/// business tables `orders` and `order_projection`.
#[async_trait]
pub(crate) trait Database: Clone + Send + Sync + 'static {
    type Outbox: OutboxStore + Clone;
    type Inbox: InboxStore + VersionTracking + ConsumerDeadLetters;

    /// Connects, drops and recreates `schema` with the business tables, and migrates the
    /// outbox and inbox tables into it.
    async fn open(url: &str, schema: &str) -> anyhow::Result<Self>;

    fn outbox(&self) -> &Self::Outbox;

    fn inbox(&self) -> Self::Inbox;

    /// Writes the order row and its event in one transaction.
    async fn place_order(
        &self,
        order: &OrderPlaced,
        trace_id: Option<String>,
        event: &NewMessage,
    ) -> anyhow::Result<()>;

    /// Upserts the projection row on the inbox's transaction; a second application
    /// shows as `times_applied > 1`.
    async fn project(
        conn: &mut <Self::Inbox as InboxStore>::Connection,
        schema: &str,
        row: Projection<'_>,
    ) -> Result<(), sqlx::Error>;

    /// The first column of the one row `sql` returns (a portable `SELECT count(*)`).
    async fn count(&self, sql: String) -> anyhow::Result<i64>;

    /// Commit-to-consume latency of every projected order, in microseconds: from the
    /// event row's `created_at` to the projection's `projected_at`.
    async fn latencies_us(&self) -> anyhow::Result<Vec<i64>>;
}

/// The `q`-quantile of `sorted` with linear interpolation between the closest ranks
/// (PostgreSQL's `percentile_cont`); `None` when empty.
pub(crate) fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let pos = q * last as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64))
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn percentile_interpolates_like_percentile_cont() {
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(percentile(&[3.0], 0.99), Some(3.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 0.5), Some(2.5));
        assert_eq!(percentile(&[0.0, 10.0], 0.99), Some(9.9));
    }
}
