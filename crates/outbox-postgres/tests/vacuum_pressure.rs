//! The claim under vacuum pressure (issue 32): while a transaction holds the xmin
//! horizon back, every completed row's entry stays in the pending index, alive for
//! PostgreSQL's purposes. A claim must not walk them all, and the claim floor that
//! spares the walk must not lose a row that commits late with an old `visible_at`. The
//! relay's gauges see the dead versions and the transaction holding them.

mod common;

use std::time::{Duration, Instant};

use common::{database_url, enqueue_committed, fresh_outbox_kept};
use outboxkit_core::{
    Completion, CompletionOutcome, NewMessage, OutboxAdmin as _, OutboxProducer, OutboxStore,
};
use outboxkit_postgres::{PgConfig, PgOutbox};
use sqlx::Connection as _;

/// A connection holding a REPEATABLE READ snapshot open: the xmin horizon of the
/// database stays where it is until it ends, as under a long report or `pg_dump`. It
/// writes nothing (no transaction id), like those.
async fn hold_xmin() -> sqlx::PgConnection {
    let mut conn = sqlx::PgConnection::connect(&database_url())
        .await
        .expect("connect");
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM pg_class;")
        .execute(&mut conn)
        .await
        .expect("hold a snapshot");
    conn
}

/// An outbox over a pool of ONE connection, so that the index statistics flushed are
/// its own (claims and floor refreshes).
async fn one_connection_outbox(schema: &str) -> PgOutbox {
    let pool = PgOutbox::connect(
        &PgConfig::new(database_url())
            .with_schema(schema)
            .with_max_connections(1),
    )
    .await
    .expect("connect")
    .pool()
    .clone();
    PgOutbox::new(pool, &PgConfig::default().with_schema(schema)).expect("outbox")
}

/// Index entries the scans of the pending index have returned so far (live or dead to
/// the scan's snapshot; entries already marked killed are passed without counting).
async fn pending_index_reads(outbox: &PgOutbox) -> i64 {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(outbox.pool())
        .await
        .expect("flush statistics");
    sqlx::query_scalar(
        "SELECT idx_tup_read FROM pg_stat_user_indexes
          WHERE schemaname = $1 AND indexrelname = 'outbox_messages_pending'",
    )
    .bind(outbox.schema())
    .fetch_one(outbox.pool())
    .await
    .expect("index statistics")
}

fn messages(n: usize, tag: &str) -> Vec<NewMessage> {
    (0..n)
        .map(|i| {
            NewMessage::builder("order", format!("{tag}-{i}"), "OrderPlaced")
                .payload(&serde_json::json!({ "n": i }))
                .build()
                .expect("valid")
        })
        .collect()
}

/// Claims up to `n` and records them sent. Returns how many were claimed.
async fn claim_and_send(outbox: &PgOutbox, n: usize) -> usize {
    let claimed = outbox
        .claim(n, Duration::from_secs(60))
        .await
        .expect("claim")
        .messages;
    let done: Vec<Completion> = claimed
        .iter()
        .map(|m| Completion {
            id: m.id,
            claim_token: m.claim_token.expect("claimed"),
            outcome: CompletionOutcome::Sent,
        })
        .collect();
    if !done.is_empty() {
        outbox.complete(&done).await.expect("complete");
    }
    claimed.len()
}

/// Claims (of nothing) until the floor has passed `at`: the refreshes run in the
/// background, started by claims.
async fn wait_for_floor_past(outbox: &PgOutbox, at: chrono::DateTime<chrono::Utc>) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while outbox.claim_floor().is_none_or(|f| f <= at) {
        assert!(
            Instant::now() < deadline,
            "the claim floor stayed at {:?}, not past {at}",
            outbox.claim_floor()
        );
        claim_and_send(outbox, 1).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn drop_schema(schema: &str) {
    let mut conn = sqlx::PgConnection::connect(&database_url())
        .await
        .expect("connect");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE"
    )))
    .execute(&mut conn)
    .await
    .expect("drop schema");
}

#[tokio::test]
async fn claims_do_not_walk_the_dead_entries_a_held_horizon_keeps() {
    const DEAD: usize = 5_000;
    const CLAIMS: usize = 50;
    let schema = fresh_outbox_kept().await.schema().to_owned();
    let outbox = one_connection_outbox(&schema).await;
    let horizon = hold_xmin().await;
    let held_since = Instant::now();

    enqueue_committed(&outbox, &messages(DEAD, "old")).await;
    let mut sent = 0;
    while sent < DEAD {
        sent += claim_and_send(&outbox, 500).await;
    }
    let last_sent: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(sqlx::AssertSqlSafe(
        format!("SELECT max(visible_at) FROM {schema}.outbox_messages"),
    ))
    .fetch_one(outbox.pool())
    .await
    .expect("newest row");
    wait_for_floor_past(&outbox, last_sent).await;

    // Now a trickle: one message at a time, each claimed and sent.
    let before = pending_index_reads(&outbox).await;
    for i in 0..CLAIMS {
        enqueue_committed(&outbox, &messages(1, &format!("new{i}"))).await;
        assert_eq!(
            claim_and_send(&outbox, 10).await,
            1,
            "the new message {i} is claimed at once"
        );
    }
    let walked = pending_index_reads(&outbox).await - before;
    eprintln!("{CLAIMS} claims walked {walked} index entries ({DEAD} dead behind the floor)");
    // Without a floor each claim walks every one of the DEAD entries: 250,000 or more.
    // With it, a few entries per claim, plus any refresh in between (a full one walks
    // the DEAD entries once).
    assert!(
        walked < (CLAIMS * DEAD / 5) as i64,
        "{CLAIMS} claims walked {walked} index entries with {DEAD} dead ones behind them"
    );

    // What the relay reports of it: the dead versions, and a transaction at least as
    // old as the one holding the horizon.
    let deadline = Instant::now() + Duration::from_secs(30);
    let pressure = loop {
        sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(outbox.pool())
            .await
            .expect("flush statistics");
        let p = outbox
            .vacuum_pressure()
            .await
            .expect("vacuum pressure")
            .expect("PostgreSQL reports it");
        if p.dead_rows >= DEAD as u64 || Instant::now() > deadline {
            break p;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(pressure.dead_rows >= DEAD as u64, "{pressure:?}");
    assert!(
        pressure.oldest_transaction_age >= Some(held_since.elapsed()),
        "{pressure:?}: the horizon has been held for {:?}",
        held_since.elapsed()
    );
    assert!(pressure.oldest_transaction.is_some(), "{pressure:?}");
    drop(horizon);
    drop_schema(&schema).await;
}

#[tokio::test]
async fn a_row_committed_below_the_floor_is_still_claimed() {
    let schema = fresh_outbox_kept().await.schema().to_owned();
    let outbox = one_connection_outbox(&schema).await;
    // A producer's transaction that reads first (no transaction id yet, so the floor's
    // look at `pg_stat_activity` cannot see it) and writes its outbox row much later:
    // the row's `visible_at` is the transaction's start, under the floor by then.
    let mut producer = sqlx::PgConnection::connect(&database_url())
        .await
        .expect("connect");
    let mut tx = producer.begin().await.expect("begin");
    let started: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut *tx)
        .await
        .expect("now");
    wait_for_floor_past(&outbox, started).await;
    outbox
        .enqueue(&mut tx, &messages(1, "late")[0])
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit");

    // A full refresh of the floor finds it (every 10 s at most).
    let deadline = Instant::now() + Duration::from_secs(30);
    while claim_and_send(&outbox, 10).await == 0 {
        assert!(
            Instant::now() < deadline,
            "the row committed under the floor was not claimed within 30 s (floor {:?})",
            outbox.claim_floor()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop_schema(&schema).await;
}
