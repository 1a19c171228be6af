//! Faults of a logical replication slot on the shared PostgreSQL, as an operator meets
//! them: the slot invalidated by PostgreSQL (`wal_status = 'lost'`, its WAL past
//! `max_slot_wal_keep_size`), and WAL the slot needs removed from `pg_wal`.
//!
//! Both change the whole server for a moment (a setting, a file of `pg_wal`): take
//! [`faults::lock`](crate::faults::lock) first. They touch only the test's slot: the
//! other slots on the server (other tests' relays) must be well ahead of it, and
//! are waited for (up to [`OTHERS_DEADLINE`]) before anything is done.

use std::time::{Duration, Instant};

use sqlx::{AssertSqlSafe, PgPool};

/// How long the other slots of the server may take to get ahead of the test's slot.
pub const OTHERS_DEADLINE: Duration = Duration::from_secs(120);

/// Segments between the test's slot and every other slot, so that a checkpoint can
/// drop the test slot's WAL and keep theirs even if the server writes a few more
/// segments meanwhile.
const MARGIN: i64 = 3;

/// SQL for the number of the WAL segment of `lsn` (an SQL expression of type `pg_lsn`).
fn segment_of(lsn: &str) -> String {
    format!(
        "floor(({lsn} - '0/0'::pg_lsn) / \
         (SELECT setting::numeric FROM pg_settings WHERE name = 'wal_segment_size'))::bigint"
    )
}

async fn segment_of_slot(pool: &PgPool, slot: &str) -> i64 {
    let sql = format!(
        "SELECT {} FROM pg_replication_slots WHERE slot_name = $1",
        segment_of("restart_lsn")
    );
    sqlx::query_scalar::<_, Option<i64>>(AssertSqlSafe(sql))
        .bind(slot)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("slot {slot}: {e}"))
        .unwrap_or_else(|| panic!("slot {slot} has no restart_lsn (already invalidated?)"))
}

async fn current_segment(pool: &PgPool) -> i64 {
    let sql = format!("SELECT {}", segment_of("pg_current_wal_lsn()"));
    sqlx::query_scalar(AssertSqlSafe(sql))
        .fetch_one(pool)
        .await
        .expect("current WAL segment")
}

async fn exec(pool: &PgPool, sql: &str) {
    sqlx::query(AssertSqlSafe(sql.to_owned()))
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// Moves the server's WAL on until the current segment is at least `segment` (a
/// record, then a segment switch, each round).
async fn write_wal_until(pool: &PgPool, segment: i64) {
    while current_segment(pool).await < segment {
        exec(
            pool,
            "SELECT pg_logical_emit_message(false, 'outbox-testkit', 'next segment')",
        )
        .await;
        exec(pool, "SELECT pg_switch_wal()").await;
    }
}

/// Waits until every slot of the server but `slot` (and those invalidated already)
/// restarts at segment `at_least` or later: a checkpoint (written first, so that
/// their readers can confirm past it) lets their readers move on.
///
/// # Panics
/// After [`OTHERS_DEADLINE`], naming the slots still behind.
async fn others_ahead(pool: &PgPool, slot: &str, at_least: i64) {
    let sql = format!(
        "SELECT slot_name::text FROM pg_replication_slots \
         WHERE slot_name <> $2 AND restart_lsn IS NOT NULL AND {} < $1",
        segment_of("restart_lsn")
    );
    let deadline = Instant::now() + OTHERS_DEADLINE;
    exec(pool, "CHECKPOINT").await;
    loop {
        let behind: Vec<String> = sqlx::query_scalar(AssertSqlSafe(sql.clone()))
            .bind(at_least)
            .bind(slot)
            .fetch_all(pool)
            .await
            .expect("other slots");
        if behind.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "other replication slots stay behind {slot}'s WAL ({behind:?}): it cannot be taken from {slot} alone"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `max_slot_wal_keep_size` as it was, restored on drop (also on panic): the value
/// `ALTER SYSTEM` had set, else reset to the configuration file's.
struct KeepSizeRestored {
    url: String,
    altered: Option<String>,
}

impl KeepSizeRestored {
    async fn take(pool: &PgPool, url: &str) -> Self {
        let altered: Option<String> = sqlx::query_scalar(
            "SELECT setting FROM pg_settings WHERE name = 'max_slot_wal_keep_size' \
             AND sourcefile LIKE '%postgresql.auto.conf'",
        )
        .fetch_optional(pool)
        .await
        .expect("max_slot_wal_keep_size");
        Self {
            url: url.to_owned(),
            altered,
        }
    }
}

impl Drop for KeepSizeRestored {
    fn drop(&mut self) {
        let (url, altered) = (self.url.clone(), self.altered.clone());
        let done = crate::on_own_runtime(async move {
            let pool = PgPool::connect(&url).await.expect("connect");
            let restore = match altered {
                Some(mb) => format!("ALTER SYSTEM SET max_slot_wal_keep_size = '{mb}MB'"),
                None => "ALTER SYSTEM RESET max_slot_wal_keep_size".to_owned(),
            };
            exec(&pool, &restore).await;
            exec(&pool, "SELECT pg_reload_conf()").await;
        });
        if !done {
            crate::leftover(
                "max_slot_wal_keep_size was not restored: run `ALTER SYSTEM RESET max_slot_wal_keep_size; SELECT pg_reload_conf()`",
            );
        }
    }
}

/// Invalidates `slot` as PostgreSQL does a slot that retained more WAL than
/// `max_slot_wal_keep_size`: the server's WAL is moved on a few segments past the
/// slot, `max_slot_wal_keep_size` is set (`ALTER SYSTEM`, reloaded) so that only the
/// test's slot falls behind it, and checkpoints run until the slot's `wal_status` is
/// `lost`; then the setting is restored (also on panic). A reader of the slot (a
/// relay stalled in an outage) has its session terminated by the server, as in
/// production. `url` connects as a superuser.
///
/// # Panics
/// When a statement fails, other slots stay behind, or the slot is not lost within
/// 30 s.
pub async fn invalidate(pool: &PgPool, url: &str, slot: &str) {
    let mine = segment_of_slot(pool, slot).await;
    write_wal_until(pool, mine + 2 * MARGIN).await;
    others_ahead(pool, slot, mine + MARGIN).await;
    let _restored = KeepSizeRestored::take(pool, url).await;
    let segment_mb: i64 = sqlx::query_scalar(
        "SELECT setting::bigint / (1024 * 1024) FROM pg_settings WHERE name = 'wal_segment_size'",
    )
    .fetch_one(pool)
    .await
    .expect("wal_segment_size");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // Everything from the segment after the slot's is kept: the others' too.
        let keep = (current_segment(pool).await - mine - 1) * segment_mb;
        exec(
            pool,
            &format!("ALTER SYSTEM SET max_slot_wal_keep_size = '{keep}MB'"),
        )
        .await;
        exec(pool, "SELECT pg_reload_conf()").await;
        // The checkpointer applies the reload on its own: a checkpoint may run before.
        exec(pool, "CHECKPOINT").await;
        let status: Option<String> =
            sqlx::query_scalar("SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1")
                .bind(slot)
                .fetch_one(pool)
                .await
                .expect("wal_status");
        if status.as_deref() == Some("lost") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "slot {slot} not invalidated (wal_status {status:?})"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Deletes from `pg_wal` the WAL segment where `slot` restarts, as an operator freeing
/// a full disk by hand might: the slot stays `reserved` in `pg_replication_slots`, and
/// its next reader fails with SQLSTATE 58P01 ("requested WAL segment ... has already
/// been removed"). The WAL is first moved on a few segments and a checkpoint written,
/// so the server itself no longer needs the segment (crash recovery starts at the
/// checkpoint); nothing is restored. The slot must not be read meanwhile. Needs the
/// server's data directory on this machine and the right to write it (root or the
/// `postgres` user).
///
/// # Panics
/// When a statement fails, other slots stay behind, or the file cannot be removed.
pub async fn remove_wal(pool: &PgPool, slot: &str) {
    let mine = segment_of_slot(pool, slot).await;
    write_wal_until(pool, mine + 2 * MARGIN).await;
    others_ahead(pool, slot, mine + MARGIN).await;
    // `pg_walfile_name` names the segment before a boundary: one byte on.
    let (dir, file): (String, String) = sqlx::query_as(
        "SELECT current_setting('data_directory'), pg_walfile_name(restart_lsn + 1) \
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_one(pool)
    .await
    .expect("the slot's WAL file");
    let path = std::path::Path::new(&dir).join("pg_wal").join(&file);
    std::fs::remove_file(&path).unwrap_or_else(|e| {
        panic!(
            "cannot remove {} (the server's data directory must be on this machine and writable): {e}",
            path.display()
        )
    });
}
