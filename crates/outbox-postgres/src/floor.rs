//! The claim floor: a `visible_at` below which no claimable outbox row is expected, so
//! that a claim's walk of the pending index starts near the live rows.
//!
//! A completed row leaves its entry in the pending index (`phase = 0`) until VACUUM
//! removes it. The first scan that finds the row dead to every transaction marks the
//! entry killed, and later scans pass it cheaply; while any transaction in the
//! database holds the xmin horizon back (a long report, an idle-in-transaction
//! session, `pg_dump`), no entry can be killed, and every claim that starts at the
//! head of the index visits the heap for each completed row since that transaction
//! began. Measured (issue 32): a relay with autovacuum off went from p50 4.9 ms to
//! 116 ms over 240,000 messages. With a floor, a claim walks only the entries since
//! about the last refresh, whatever the number behind it.
//!
//! The floor is `min(F, T_x, T_r) - MARGIN`, refreshed in the background (never on the
//! claim's path) at most every [`REFRESH_EVERY`]:
//! - `T_r`: the database clock when the refresh read `pg_stat_activity`;
//! - `T_x`: the oldest start of a transaction of this database that holds a
//!   transaction id (it has written something, so it may commit outbox rows whose
//!   `visible_at`, its `now()`, is that old), read first;
//! - `F`: then, in a later statement (a later snapshot), the oldest pending row
//!   (`phase = 0`: New, retrying or in flight) from the previous floor on, or from the
//!   start of the index at every [`FULL_EVERY`]-th refresh.
//!
//! A row that commits after its refresh read with a `visible_at` below the floor (a
//! transaction that wrote nothing until after the read and began more than `MARGIN`
//! earlier, or one whose start `pg_stat_activity` hides from a role without
//! `pg_read_all_stats`) is not lost: the next full refresh finds it and lowers the
//! floor, within `REFRESH_EVERY × FULL_EVERY` (10 s). A row in flight stays above the
//! floor, so an expired lease is reclaimed as before.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::PgPool;

/// The least time between two refreshes of the floor.
pub(crate) const REFRESH_EVERY: Duration = Duration::from_millis(250);
/// Every this many refreshes, `F` is searched from the start of the pending index (the
/// refresh then walks every dead entry, once per `REFRESH_EVERY × FULL_EVERY`).
pub(crate) const FULL_EVERY: u64 = 40;
/// Subtracted from the floor: covers a transaction that began shortly before the
/// refresh and had not written yet.
const MARGIN: chrono::TimeDelta = chrono::TimeDelta::seconds(1);

/// The oldest writing transaction of this database, and the time it was read at.
const ACTIVITY: &str = "SELECT clock_timestamp(),
        (SELECT min(a.xact_start) FROM pg_stat_activity a
          WHERE a.datname = current_database() AND a.backend_xid IS NOT NULL
            AND a.pid <> pg_backend_pid())";

/// The floor shared by an outbox's clones.
#[derive(Debug, Default)]
pub(crate) struct ClaimFloor {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// `None` until the first refresh: claims walk from the start of the index.
    floor: Option<DateTime<Utc>>,
    refreshing: bool,
    last_refresh: Option<Instant>,
    refreshes: u64,
}

impl ClaimFloor {
    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        f(&mut self.state.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The current floor (`None`: unbounded).
    pub(crate) fn get(&self) -> Option<DateTime<Utc>> {
        self.with(|s| s.floor)
    }

    /// Starts a refresh in the background when one is due and none runs. `oldest_sql`
    /// is the statement that returns the oldest pending row's `visible_at` at or above
    /// `$1` (`NULL`: from the start).
    pub(crate) fn refresh_if_due(self: &Arc<Self>, pool: &PgPool, oldest_sql: &Arc<str>) {
        let Some((from, full)) = self.with(|s| {
            let due = !s.refreshing && s.last_refresh.is_none_or(|t| t.elapsed() >= REFRESH_EVERY);
            due.then(|| {
                s.refreshing = true;
                let full = s.refreshes.is_multiple_of(FULL_EVERY);
                s.refreshes += 1;
                (if full { None } else { s.floor }, full)
            })
        }) else {
            return;
        };
        let this = Arc::clone(self);
        let pool = pool.clone();
        let oldest_sql = Arc::clone(oldest_sql);
        tokio::spawn(async move {
            let result = refresh(&pool, &oldest_sql, from).await;
            this.with(|s| {
                s.refreshing = false;
                s.last_refresh = Some(Instant::now());
                match result {
                    Ok(floor) => s.floor = Some(floor),
                    // Keep the old floor: a full refresh that failed is retried next.
                    Err(e) => {
                        if full {
                            s.refreshes = 0;
                        }
                        tracing::debug!(error = %e, "claim floor refresh failed");
                    }
                }
            });
        });
    }
}

/// One refresh: `pg_stat_activity` first, then the oldest pending row.
async fn refresh(
    pool: &PgPool,
    oldest_sql: &Arc<str>,
    from: Option<DateTime<Utc>>,
) -> Result<DateTime<Utc>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let (read_at, oldest_writer): (DateTime<Utc>, Option<DateTime<Utc>>) =
        sqlx::query_as(ACTIVITY).fetch_one(&mut *conn).await?;
    let oldest_pending: Option<DateTime<Utc>> = sqlx::query_scalar(crate::sql::sql(oldest_sql))
        .bind(from)
        .fetch_optional(&mut *conn)
        .await?;
    Ok(floor_of(read_at, oldest_writer, oldest_pending))
}

/// `min(F, T_x, T_r) - MARGIN`.
fn floor_of(
    read_at: DateTime<Utc>,
    oldest_writer: Option<DateTime<Utc>>,
    oldest_pending: Option<DateTime<Utc>>,
) -> DateTime<Utc> {
    [oldest_writer, oldest_pending]
        .into_iter()
        .flatten()
        .fold(read_at, DateTime::min)
        - MARGIN
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_floor_is_the_oldest_of_the_three_less_the_margin() {
        let t = |s: i64| DateTime::from_timestamp(1_800_000_000 + s, 0).expect("time");
        assert_eq!(floor_of(t(10), None, None), t(9));
        assert_eq!(floor_of(t(10), Some(t(4)), None), t(3));
        assert_eq!(floor_of(t(10), None, Some(t(2))), t(1));
        assert_eq!(floor_of(t(10), Some(t(4)), Some(t(6))), t(3));
        // A scheduled row (visible later) does not lift the floor above now.
        assert_eq!(floor_of(t(10), None, Some(t(60))), t(9));
    }
}
