//! Bad input that must not break the backend: schema names that are reserved words,
//! error filters holding `LIKE` wildcards, payloads over the limit.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{database_url, fresh_outbox};
use outboxkit_core::inbox::{ConsumerDeadLetters, DurableInbox, VersionTracking};
use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{
    Completion, CompletionOutcome, DEFAULT_MAX_PAYLOAD_BYTES, InboxStore, InvalidMessage,
    MessageFilter, NewMessage, OnDead, OutboxError, OutboxProducer, OutboxStore,
};
use outboxkit_core::{InboxDeadFilter, InboxReplayMode, OutboxAdmin as _};
use outboxkit_postgres::{PgConfig, PgOutbox};
use sqlx::AssertSqlSafe;
use uuid::Uuid;

fn event(aggregate: &str, payload: &str) -> NewMessage {
    NewMessage::builder("order", aggregate, "OrderPlaced")
        .aggregate_version(1)
        .payload_json(payload)
        .build()
        .expect("valid")
}

/// A JSON string payload of exactly `len` bytes of JSON text.
fn payload_of(len: usize) -> String {
    format!("\"{}\"", "x".repeat(len - 2))
}

async fn count(outbox: &PgOutbox, table: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM \"{}\".{table}",
        outbox.schema()
    )))
    .fetch_one(outbox.pool())
    .await
    .expect("count")
}

/// A schema named after a reserved word, dropped when the test ends (even on failure).
struct ReservedSchema(PgOutbox);

impl ReservedSchema {
    async fn new(name: &str) -> Self {
        let outbox = PgOutbox::connect(
            &PgConfig::new(database_url())
                .with_schema(name)
                .with_max_connections(4),
        )
        .await
        .expect("connect to PostgreSQL");
        // Left behind by an interrupted run.
        drop_schema(&outbox).await;
        Self(outbox)
    }
}

impl Drop for ReservedSchema {
    fn drop(&mut self) {
        let outbox = self.0.clone();
        // The test's runtime is shutting down or busy: drop on a runtime of our own.
        let _ = std::thread::spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                rt.block_on(async {
                    let pool = sqlx::PgPool::connect(&database_url()).await;
                    if let Ok(pool) = pool {
                        let _ = sqlx::raw_sql(AssertSqlSafe(format!(
                            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
                            outbox.schema()
                        )))
                        .execute(&pool)
                        .await;
                    }
                });
            }
        })
        .join();
    }
}

async fn drop_schema(outbox: &PgOutbox) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
        outbox.schema()
    )))
    .execute(outbox.pool())
    .await
    .expect("drop schema");
}

/// Every statement of the backend, outbox, operator queries and inbox alike, against a
/// schema whose name is a reserved word (`"order"`, `"group"`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserved_words_are_valid_schema_names() {
    for name in ["order", "group"] {
        let schema = ReservedSchema::new(name).await;
        let outbox = &schema.0;
        assert_eq!(
            outbox.migrate().await.expect("migrate"),
            (1..=outboxkit_postgres::LATEST_VERSION).collect::<Vec<_>>()
        );
        assert!(outbox.migrate().await.expect("again").is_empty());

        let (a, b) = (event("1", "{}"), event("2", "{}"));
        let mut tx = outbox.begin().await.expect("begin");
        outbox
            .enqueue_batch(&mut tx, &[a.clone(), b.clone()])
            .await
            .expect("enqueue");
        tx.commit().await.expect("commit");

        let claimed = outbox
            .claim(1, Duration::from_secs(30))
            .await
            .expect("claim")
            .messages;
        let ordered = outbox
            .claim_ordered(10, Duration::from_secs(30), OnDead::Block)
            .await
            .expect("claim ordered")
            .messages;
        assert_eq!(claimed.len() + ordered.len(), 2);
        let done: Vec<Completion> = claimed
            .iter()
            .chain(&ordered)
            .map(|m| Completion {
                id: m.id,
                claim_token: m.claim_token.expect("token"),
                outcome: if m.id == a.id {
                    CompletionOutcome::Sent
                } else {
                    CompletionOutcome::Dead {
                        error: "no_route".into(),
                    }
                },
            })
            .collect();
        assert_eq!(outbox.complete(&done).await.expect("complete").applied, 2);
        let stats = outbox.stats().await.expect("stats");
        assert_eq!((stats.sent, stats.dead), (1, 1));
        assert_eq!(outbox.pending_stats().await.expect("pending").dead, 1);
        assert_eq!(outbox.stats_by_group().await.expect("groups").len(), 1);
        assert!(outbox.blocked_keys(10).await.expect("blocked").len() == 1);
        for ordered in [None, Some(OnDead::Block), Some(OnDead::Skip)] {
            outbox
                .oldest_claimable_wait(ordered)
                .await
                .expect("oldest claimable");
        }
        assert!(outbox.get(a.id).await.expect("get").is_some());
        let dead_filter = MessageFilter::new().with_error_containing("_");
        assert_eq!(
            outbox
                .dead_letters(&dead_filter, 10)
                .await
                .expect("dead")
                .len(),
            1
        );
        assert_eq!(
            outbox
                .replay(&dead_filter, true)
                .await
                .expect("dry")
                .matched,
            1
        );
        let now = chrono::Utc::now();
        let lines = outbox
            .reconcile(
                now - chrono::Duration::hours(1),
                now + chrono::Duration::hours(1),
                &[],
            )
            .await
            .expect("reconcile");
        assert!(lines.is_empty(), "no consumer known yet: {lines:?}");
        assert_eq!(
            outbox
                .archive_sent(Duration::ZERO, 10)
                .await
                .expect("archive"),
            1
        );
        assert_eq!(
            outbox.purge_sent(Duration::ZERO, 10).await.expect("purge"),
            0
        );

        let inbox = outbox.inbox();
        let mut tx = inbox.begin().await.expect("begin");
        assert!(inbox.try_claim(&mut tx, a.id, "c").await.expect("claim"));
        assert_eq!(
            inbox
                .applied_version(&mut tx, "c", "order", "1")
                .await
                .expect("version"),
            None
        );
        inbox
            .record_version(&mut tx, "c", "order", "1", 1)
            .await
            .expect("record version");
        inbox.commit(tx).await.expect("commit");
        let msg = IncomingMessage::new(b.id, "OrderPlaced", b"{}".to_vec());
        assert!(
            inbox
                .record_failure(&msg, "c", "boom_1", 1)
                .await
                .expect("failure")
                .dead
        );
        assert!(inbox.is_dead(b.id, "c").await.expect("is dead"));
        assert_eq!(
            inbox
                .consumer_dead_letters(None, 10)
                .await
                .expect("dead")
                .len(),
            1
        );
        let stored = IncomingMessage::new(Uuid::now_v7(), "OrderPlaced", b"{}".to_vec());
        assert!(DurableInbox::store(&inbox, &stored).await.expect("store"));
        assert_eq!(
            DurableInbox::claim(&inbox, 10, Duration::from_secs(30))
                .await
                .expect("claim")
                .len(),
            1
        );
        assert_eq!(
            inbox
                .purge_processed(Duration::ZERO, 10)
                .await
                .expect("purge"),
            0
        );
        let mut filter = InboxDeadFilter::new();
        filter.error_contains = Some("_".into());
        assert_eq!(
            outbox
                .inbox_dead_letters(&filter, 10)
                .await
                .expect("inbox dead")
                .len(),
            1
        );
        let report = outbox
            .replay_inbox_dead_letters(&filter, InboxReplayMode::Republish)
            .await
            .expect("inbox replay");
        assert_eq!((report.matched, report.replayed), (1, 1));
        assert_eq!(
            outbox
                .archive_inbox_records(Duration::ZERO, 10)
                .await
                .expect("archive inbox"),
            1
        );
        assert_eq!(
            InboxStore::purge(&inbox, Duration::ZERO, 10)
                .await
                .expect("purge"),
            0
        );
        drop_schema(outbox).await;
    }
}

/// The consumer-side error filters (`outbox inbox dead list|replay --error-contains`)
/// match literal text, case-insensitively, in both tables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_error_filters_match_literal_text() {
    let outbox = fresh_outbox().await;
    let s = outbox.schema();
    let errors = [
        "plain error",
        "rate 100% reached",
        "no_route",
        "C:\\temp",
        "MiXeD",
    ];
    let mut failures = Vec::new();
    let mut durable = Vec::new();
    for error in errors {
        let (f, d) = (Uuid::now_v7(), Uuid::now_v7());
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {s}.inbox_failures (message_id, consumer, event_type, attempts, last_error, dead_at)
             VALUES ($1, 'projector', 'OrderPlaced', 5, $2, now())"
        )))
        .bind(f)
        .bind(format!("projector: {error}"))
        .execute(outbox.pool())
        .await
        .expect("failure row");
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {s}.inbox_messages (id, event_type, payload, status, attempts, last_error)
             VALUES ($1, 'OrderPlaced', '\\x7b7d'::bytea, 3, 5, $2)"
        )))
        .bind(d)
        .bind(format!("projector: {error}"))
        .execute(outbox.pool())
        .await
        .expect("durable row");
        failures.push(f);
        durable.push(d);
    }
    let ids = |i: usize| BTreeSet::from([failures[i], durable[i]]);
    for (text, want) in [
        ("%", ids(1)),
        ("_", ids(2)),
        ("o_r", ids(2)),
        ("e_r", BTreeSet::new()),
        ("\\", ids(3)),
        ("mixed", ids(4)),
        ("PROJECTOR: plain", ids(0)),
    ] {
        let mut filter = InboxDeadFilter::new();
        filter.error_contains = Some(text.to_owned());
        let got: BTreeSet<Uuid> = outbox
            .inbox_dead_letters(&filter, 100)
            .await
            .expect("list")
            .iter()
            .map(|d| d.message_id)
            .collect();
        assert_eq!(got, want, "dead letters whose error contains {text:?}");
        let dry = outbox
            .replay_inbox_dead_letters(&filter, InboxReplayMode::DryRun)
            .await
            .expect("dry run");
        assert_eq!(dry.matched, want.len() as u64, "replay matching {text:?}");
    }
}

/// A payload over the limit is refused with a typed error before anything is sent to
/// the database: a batch holding one is not written at all, and the caller's
/// transaction stays usable. A payload exactly at the limit is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_over_the_limit_are_refused_before_anything_is_written() {
    let outbox = fresh_outbox().await;
    assert_eq!(outbox.max_payload_bytes(), DEFAULT_MAX_PAYLOAD_BYTES);
    let max = DEFAULT_MAX_PAYLOAD_BYTES;
    let small = event("1", "{}");
    let over = event("2", &payload_of(max + 1));
    let mut tx = outbox.begin().await.expect("begin");
    let err = outbox
        .enqueue_batch(&mut tx, &[small.clone(), over])
        .await
        .expect_err("over the limit");
    assert!(
        matches!(
            err,
            OutboxError::InvalidMessage(InvalidMessage::PayloadTooLarge { size, max: m })
                if size == max + 1 && m == max
        ),
        "{err:?}"
    );
    assert_eq!(err.kind(), outboxkit_core::ErrorKind::Permanent);
    // Nothing reached the database: the transaction is not aborted.
    tx.commit().await.expect("commit");
    assert_eq!(count(&outbox, "outbox_messages").await, 0);

    let at_limit = event("3", &payload_of(max));
    let mut tx = outbox.begin().await.expect("begin");
    outbox
        .enqueue(&mut tx, &at_limit)
        .await
        .expect("at the limit");
    tx.commit().await.expect("commit");
    assert_eq!(count(&outbox, "outbox_messages").await, 1);
    let stored = outbox.get(at_limit.id).await.expect("get").expect("row");
    assert_eq!(stored.payload.get().len(), max);

    // The limit is configurable through the config, with a pool of one's own or not.
    let tight = PgOutbox::new(
        outbox.pool().clone(),
        &PgConfig::default()
            .with_schema(outbox.schema())
            .with_max_payload_bytes(16),
    )
    .expect("outbox");
    let mut tx = outbox.begin().await.expect("begin");
    let err = tight
        .enqueue(&mut tx, &event("4", &payload_of(17)))
        .await
        .expect_err("over 16 bytes");
    assert!(matches!(
        err,
        OutboxError::InvalidMessage(InvalidMessage::PayloadTooLarge { size: 17, max: 16 })
    ));
    tight
        .enqueue(&mut tx, &event("5", &payload_of(16)))
        .await
        .expect("16 bytes");
    tx.commit().await.expect("commit");
    assert_eq!(count(&outbox, "outbox_messages").await, 2);
    let configured = PgOutbox::connect(
        &PgConfig::new(database_url())
            .with_schema(outbox.schema())
            .with_max_connections(1)
            .with_max_payload_bytes(16),
    )
    .await
    .expect("connect");
    assert_eq!(configured.max_payload_bytes(), 16);
}
