//! InnoDB concurrency facts, each measured on the real MariaDB / MySQL: several
//! claimers over one backlog take every row exactly once; claims, completions and
//! producers' inserts under load lose nothing (a claim or completion made a deadlock
//! victim is run again by the store and counted); racing inbox claims of one `(message_id, consumer)` pair
//! let exactly one commit.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{enqueue_committed, fresh_outbox};
use outboxkit_core::{
    Completion, CompletionOutcome, ErrorKind, InboxStore, NewMessage, OutboxError, OutboxStore,
};
use uuid::Uuid;

fn messages(n: usize) -> Vec<NewMessage> {
    (0..n)
        .map(|i| {
            NewMessage::builder("order", format!("o-{i}"), "OrderPlaced")
                .payload(&serde_json::json!({ "n": i }))
                .build()
                .expect("valid")
        })
        .collect()
}

/// Whether `e` is an InnoDB deadlock (error 1213), the one failure these tests count
/// and retry.
fn is_deadlock(e: &OutboxError) -> bool {
    match e {
        OutboxError::Database { source, kind, .. } => {
            *kind == ErrorKind::Transient
                && source
                    .downcast_ref::<sqlx::Error>()
                    .and_then(|e| match e {
                        sqlx::Error::Database(d) => d
                            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                            .map(|d| d.number() == 1213),
                        _ => None,
                    })
                    .unwrap_or(false)
        }
        _ => false,
    }
}

/// The server's count of deadlocks (global: only meaningful while nothing else runs).
async fn server_deadlocks(pool: &sqlx::MySqlPool) -> i64 {
    let row: Option<(String, String)> =
        sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'")
            .fetch_optional(pool)
            .await
            .expect("status");
    row.and_then(|(_, v)| v.parse().ok()).unwrap_or(0)
}

/// 4 claimers (batches of 100, completing each batch Sent) over 10,000 committed rows:
/// every row is claimed exactly once and nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_claimers_take_each_of_10000_rows_exactly_once() {
    let (outbox, _drop) = fresh_outbox().await;
    let all = messages(10_000);
    enqueue_committed(&outbox, &all).await;
    let outbox = Arc::new(outbox);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let outbox = Arc::clone(&outbox);
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            loop {
                let batch = outbox
                    .claim(100, Duration::from_secs(60))
                    .await
                    .expect("claim");
                if batch.messages.is_empty() {
                    return seen;
                }
                let done: Vec<Completion> = batch
                    .messages
                    .iter()
                    .map(|m| Completion {
                        id: m.id,
                        claim_token: m.claim_token.expect("token"),
                        outcome: CompletionOutcome::Sent,
                    })
                    .collect();
                let report = outbox.complete(&done).await.expect("complete");
                assert_eq!(report.applied, done.len() as u64);
                seen.extend(batch.messages.iter().map(|m| m.id));
            }
        }));
    }
    let mut counts: HashMap<Uuid, u32> = HashMap::new();
    let mut per_claimer = Vec::new();
    for task in tasks {
        let seen = task.await.expect("claimer");
        per_claimer.push(seen.len());
        for id in seen {
            *counts.entry(id).or_default() += 1;
        }
    }
    let elapsed = started.elapsed();
    assert_eq!(counts.len(), 10_000, "every row claimed");
    assert!(counts.values().all(|&n| n == 1), "no row claimed twice");
    let stats = outbox.stats().await.expect("stats");
    assert_eq!((stats.new, stats.processing, stats.sent), (0, 0, 10_000));
    println!(
        "4 claimers, 10,000 rows: {:.0} rows/s claimed and completed ({:?}; per claimer {per_claimer:?}; deadlock victims run again: {})",
        10_000.0 / elapsed.as_secs_f64(),
        elapsed,
        outbox.deadlock_retries()
    );
}

/// Under load (2 producers inserting while 4 claimers claim and complete with every
/// outcome: Sent, Retry without delay, Release), a claim or completion that InnoDB makes
/// a deadlock victim is run again by the store and counted (`deadlock_retries`); no
/// deadlock reaches the caller, and every message still ends Sent exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_completions_and_inserts_under_load_do_not_deadlock() {
    let (outbox, _drop) = fresh_outbox().await;
    let outbox = Arc::new(outbox);
    let deadlocks_before = server_deadlocks(outbox.pool()).await;
    let deadlocks = Arc::new(AtomicU64::new(0));
    const PER_PRODUCER: usize = 3_000;
    let mut producers = Vec::new();
    for _ in 0..2 {
        let outbox = Arc::clone(&outbox);
        producers.push(tokio::spawn(async move {
            for chunk in messages(PER_PRODUCER).chunks(50) {
                enqueue_committed(&outbox, chunk).await;
            }
        }));
    }
    let producing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let mut claimers = Vec::new();
    for c in 0..4u64 {
        let (outbox, deadlocks, producing) = (
            Arc::clone(&outbox),
            Arc::clone(&deadlocks),
            Arc::clone(&producing),
        );
        claimers.push(tokio::spawn(async move {
            let mut sent = Vec::new();
            let mut round = c;
            loop {
                let batch = match outbox.claim(50, Duration::from_secs(60)).await {
                    Ok(b) => b,
                    Err(e) if is_deadlock(&e) => {
                        deadlocks.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    Err(e) => panic!("claim: {e}"),
                };
                if batch.messages.is_empty() {
                    if !producing.load(Ordering::Relaxed) {
                        return sent;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                let done: Vec<Completion> = batch
                    .messages
                    .iter()
                    .map(|m| {
                        round += 1;
                        Completion {
                            id: m.id,
                            claim_token: m.claim_token.expect("token"),
                            outcome: match round % 5 {
                                0 => CompletionOutcome::Retry {
                                    delay: Duration::ZERO,
                                    error: "retry".into(),
                                },
                                1 => CompletionOutcome::Release,
                                _ => CompletionOutcome::Sent,
                            },
                        }
                    })
                    .collect();
                loop {
                    match outbox.complete(&done).await {
                        Ok(report) => {
                            assert!(report.fenced.is_empty(), "nothing fenced: leases are long");
                            break;
                        }
                        Err(e) if is_deadlock(&e) => {
                            deadlocks.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("complete: {e}"),
                    }
                }
                sent.extend(
                    done.iter()
                        .filter(|c| matches!(c.outcome, CompletionOutcome::Sent))
                        .map(|c| c.id),
                );
            }
        }));
    }
    for p in producers {
        p.await.expect("producer");
    }
    producing.store(false, Ordering::Relaxed);
    let mut counts: HashMap<Uuid, u32> = HashMap::new();
    for c in claimers {
        for id in c.await.expect("claimer") {
            *counts.entry(id).or_default() += 1;
        }
    }
    // Rows retried or released after the last claim are picked up by one more pass.
    loop {
        let batch = outbox
            .claim(500, Duration::from_secs(60))
            .await
            .expect("claim");
        if batch.messages.is_empty() {
            break;
        }
        let done: Vec<Completion> = batch
            .messages
            .iter()
            .map(|m| Completion {
                id: m.id,
                claim_token: m.claim_token.expect("token"),
                outcome: CompletionOutcome::Sent,
            })
            .collect();
        outbox.complete(&done).await.expect("complete");
        for c in &done {
            *counts.entry(c.id).or_default() += 1;
        }
    }
    let deadlocked = deadlocks.load(Ordering::Relaxed);
    let server = server_deadlocks(outbox.pool()).await - deadlocks_before;
    println!(
        "under load: {} messages, deadlock victims run again by the store: {}, deadlocks reaching the caller: {deadlocked}, counted by the server: {server}",
        counts.len(),
        outbox.deadlock_retries()
    );
    assert_eq!(counts.len(), 2 * PER_PRODUCER, "no message lost");
    assert!(counts.values().all(|&n| n == 1), "each sent exactly once");
    assert_eq!(deadlocked, 0, "no deadlock reaches the caller");
}

/// Four transactions claim the same `(message_id, consumer)` pair at once, for 40
/// pairs, each writing an effect row beside its claim; one of each pair's first
/// claimers rolls back, the others commit. Exactly one effect per pair commits. A
/// claimer that InnoDB makes a deadlock victim (possible when several wait on the
/// primary-key record of an insert that rolls back) retries, as a redelivery would,
/// and is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_inbox_claims_of_one_pair_let_exactly_one_commit() {
    let (outbox, _drop) = fresh_outbox().await;
    let s = outbox.schema().to_owned();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE `{s}`.effects (message_id BINARY(16) NOT NULL, claimer INT NOT NULL) ENGINE = InnoDB"
    )))
    .execute(outbox.pool())
    .await
    .expect("effects table");
    let inbox = Arc::new(outbox.inbox());
    let deadlocks = Arc::new(AtomicU64::new(0));
    let rolled_back = Arc::new(AtomicU64::new(0));
    for _ in 0..40 {
        let id = Uuid::now_v7();
        let barrier = Arc::new(tokio::sync::Barrier::new(4));
        let mut racers = Vec::new();
        for claimer in 0..4 {
            let (inbox, deadlocks, rolled_back, barrier, s) = (
                Arc::clone(&inbox),
                Arc::clone(&deadlocks),
                Arc::clone(&rolled_back),
                Arc::clone(&barrier),
                s.clone(),
            );
            racers.push(tokio::spawn(async move {
                barrier.wait().await;
                let mut first = true;
                loop {
                    let mut tx = inbox.begin().await.expect("begin");
                    let claimed = match inbox.try_claim(&mut tx, id, "projector").await {
                        Ok(c) => c,
                        Err(e) if is_deadlock(&e) => {
                            deadlocks.fetch_add(1, Ordering::Relaxed);
                            let _ = inbox.rollback(tx).await;
                            continue;
                        }
                        Err(e) => panic!("claim: {e}"),
                    };
                    if !claimed {
                        inbox.rollback(tx).await.expect("rollback");
                        return;
                    }
                    sqlx::query(sqlx::AssertSqlSafe(format!(
                        "INSERT INTO `{s}`.effects (message_id, claimer) VALUES (?, ?)"
                    )))
                    .bind(id)
                    .bind(claimer)
                    .execute(&mut *tx)
                    .await
                    .expect("effect");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    // Claimer 0's first winning attempt fails (its handler errs): the
                    // pair must go to one of the others, or to its own retry.
                    if claimer == 0 && first {
                        first = false;
                        rolled_back.fetch_add(1, Ordering::Relaxed);
                        inbox.rollback(tx).await.expect("rollback");
                        continue;
                    }
                    match inbox.commit(tx).await {
                        Ok(()) => return,
                        Err(e) if is_deadlock(&e) => {
                            deadlocks.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("commit: {e}"),
                    }
                }
            }));
        }
        for r in racers {
            r.await.expect("racer");
        }
        let effects: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM `{s}`.effects WHERE message_id = ?"
        )))
        .bind(id)
        .fetch_one(outbox.pool())
        .await
        .expect("effects");
        assert_eq!(effects, 1, "exactly one claimer's effect committed");
    }
    println!(
        "40 pairs x 4 racing claimers: {} first winners rolled back, {} deadlock victims retried",
        rolled_back.load(Ordering::Relaxed),
        deadlocks.load(Ordering::Relaxed)
    );
}

/// The idempotent consumer's claim runs on its transaction's connection alone: with a
/// pool of one connection, held by the transaction, `claim_unless_dead` still answers
/// (the trait's default asked the pool for a second connection and waited for it until
/// the acquire timeout; with every connection held so, a consumer stopped progressing).
#[tokio::test]
async fn claim_unless_dead_needs_no_second_connection() {
    use outboxkit_core::{ConsumerDeadLetters as _, InboxClaim};
    let (outbox, _drop) = fresh_outbox().await;
    let config = outboxkit_mysql::MySqlConfig::new(common::mysql_url())
        .with_schema(outbox.schema())
        .with_max_connections(1)
        .with_acquire_timeout(Duration::from_secs(2));
    let inbox = outboxkit_mysql::MySqlOutbox::connect(&config)
        .await
        .expect("outbox")
        .inbox();
    let mut tx = inbox.begin().await.expect("begin");
    let id = Uuid::now_v7();
    let claim = tokio::time::timeout(
        Duration::from_secs(10),
        inbox.claim_unless_dead(&mut tx, id, "projector"),
    )
    .await
    .expect("answers")
    .expect("claim");
    assert_eq!(claim, InboxClaim::Claimed);
    let again = inbox
        .claim_unless_dead(&mut tx, id, "projector")
        .await
        .expect("claim again");
    assert_eq!(again, InboxClaim::Duplicate);
    inbox.rollback(tx).await.expect("rollback");
}

/// A completion under `SentRetention::Delete` is two statements: the `UPDATE` that
/// records the outcomes (and commits), then the `DELETE` of the Sent rows. When the
/// `DELETE` fails as a deadlock victim, the store runs it again (not the whole
/// completion, whose `UPDATE` would then match nothing): every message is reported
/// applied, none fenced, and the rows are deleted. When it fails otherwise (a lock-wait
/// timeout), the outcomes stand: reported applied (an error would make the dispatcher
/// complete again and be told every message was fenced), the rows left `Sent` for the
/// purge. The failure is injected once by a trigger on the `DELETE` (its count in a
/// non-transactional table, so the failed statement's rollback does not undo it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_whose_delete_fails_still_reports_what_it_applied() {
    for (errno, deleted) in [(1213, true), (1205, false)] {
        let (outbox, _drop) = fresh_outbox().await;
        let s = outbox.schema().to_owned();
        for statement in [
            format!("CREATE TABLE `{s}`.delete_failures (n INT NOT NULL) ENGINE = MyISAM"),
            format!("INSERT INTO `{s}`.delete_failures VALUES (1)"),
            format!(
                "CREATE TRIGGER `{s}`.fail_delete_once BEFORE DELETE ON `{s}`.outbox_messages
                 FOR EACH ROW BEGIN
                     IF (SELECT n FROM `{s}`.delete_failures) > 0 THEN
                         UPDATE `{s}`.delete_failures SET n = n - 1;
                         SIGNAL SQLSTATE 'HY000'
                            SET MYSQL_ERRNO = {errno}, MESSAGE_TEXT = 'injected by the test';
                     END IF;
                 END"
            ),
        ] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
                .execute(outbox.pool())
                .await
                .expect("fault injection");
        }
        let store = outboxkit_mysql::MySqlOutbox::new(
            outbox.pool().clone(),
            &outboxkit_mysql::MySqlConfig::default()
                .with_schema(&s)
                .with_sent_retention(outboxkit_core::SentRetention::Delete),
        )
        .expect("store");
        enqueue_committed(&store, &messages(5)).await;
        let batch = store
            .claim(10, Duration::from_secs(60))
            .await
            .expect("claim");
        assert_eq!(batch.messages.len(), 5);
        let done: Vec<Completion> = batch
            .messages
            .iter()
            .map(|m| Completion {
                id: m.id,
                claim_token: m.claim_token.expect("token"),
                outcome: CompletionOutcome::Sent,
            })
            .collect();
        let report = store
            .complete(&done)
            .await
            .unwrap_or_else(|e| panic!("error {errno}: the completion is recorded: {e:?}"));
        assert_eq!(
            (report.applied, report.fenced.clone()),
            (5, Vec::new()),
            "error {errno}: every message applied, none fenced: {report:?}"
        );
        let injected: i32 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT n FROM `{s}`.delete_failures"
        )))
        .fetch_one(outbox.pool())
        .await
        .expect("injected");
        assert_eq!(injected, 0, "the fault was injected");
        let left: Vec<i16> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT status FROM `{s}`.outbox_messages"
        )))
        .fetch_all(outbox.pool())
        .await
        .expect("rows");
        if deleted {
            assert_eq!(
                left,
                Vec::<i16>::new(),
                "error {errno}: the Sent rows are deleted"
            );
            assert_eq!(store.deadlock_retries(), 1, "the DELETE ran again");
        } else {
            assert_eq!(
                left,
                vec![1; 5],
                "error {errno}: the rows stay Sent, for the purge"
            );
        }
    }
}
