//! Batch mode of the inbox against the real PostgreSQL: `IdempotentConsumer` as a
//! `BatchDeliveryHandler` (one transaction per batch), the durable receiver's batched
//! store and the processor's batched transactions. The same guarantees as per-message
//! mode (`tests/inbox.rs`), and the round trips a batch costs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outboxkit_core::RetryPolicy;
use outboxkit_core::consumer::{BatchDeliveryHandler, HandlerDecision};
use outboxkit_core::inbox::{ConsumerDeadLetters, DurableInbox};
use outboxkit_core::wire::IncomingMessage;
use outboxkit_inbox::{
    BatchHandlerError, ConsumerConfig, DurableReceiver, Handler, HandlerContext, HandlerError,
    IdempotentConsumer, InboxProcessor, Pipeline, ProcessorConfig, StalePolicy, UNHANDLED_CONSUMER,
    UnhandledPolicy,
};
use outboxkit_postgres::{PgConfig, PgInbox, PgOutbox};
use sqlx::{AssertSqlSafe, PgConnection};
use uuid::Uuid;

use HandlerDecision::{Ack, Defer, Requeue};

mod common;

use common::{Db, database_url, db, message};

/// Writes one effect row per message; fails (or panics on) the messages listed, each
/// time; counts its calls per message; can sleep inside the transaction.
#[derive(Clone)]
struct Effect {
    schema: String,
    fails: Arc<Mutex<Vec<Uuid>>>,
    panics: bool,
    permanent: bool,
    calls: Arc<Mutex<HashMap<Uuid, u32>>>,
    pause: Duration,
}

impl Effect {
    fn new(db: &Db) -> Self {
        Self {
            schema: db.schema.clone(),
            fails: Arc::default(),
            panics: false,
            permanent: false,
            calls: Arc::default(),
            pause: Duration::ZERO,
        }
    }

    fn failing_on(self, id: Uuid) -> Self {
        self.fails.lock().expect("lock").push(id);
        self
    }

    fn calls(&self, id: Uuid) -> u32 {
        self.calls
            .lock()
            .expect("lock")
            .get(&id)
            .copied()
            .unwrap_or(0)
    }

    fn total_calls(&self) -> u32 {
        self.calls.lock().expect("lock").values().sum()
    }
}

#[async_trait]
impl Handler<PgInbox> for Effect {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &IncomingMessage,
        ctx: &HandlerContext,
    ) -> Result<(), HandlerError> {
        *self.calls.lock().expect("lock").entry(msg.id).or_default() += 1;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.effects (message_id, consumer, version, stale) VALUES ($1, $2, $3, $4)",
            self.schema
        )))
        .bind(msg.id)
        .bind(&ctx.consumer)
        .bind(msg.aggregate_version)
        .bind(ctx.stale)
        .execute(&mut *conn)
        .await?;
        if !self.pause.is_zero() {
            tokio::time::sleep(self.pause).await;
        }
        if self.fails.lock().expect("lock").contains(&msg.id) {
            assert!(!self.panics, "projection bug (expected by the test)");
            let e = std::io::Error::other("injected failure");
            return Err(if self.permanent {
                HandlerError::permanent(e)
            } else {
                HandlerError::retryable(e)
            });
        }
        Ok(())
    }
}

/// `n` messages of fresh aggregates.
fn fresh(n: usize) -> Vec<IncomingMessage> {
    (0..n)
        .map(|_| message("OrderPlaced", &Uuid::new_v4().to_string(), 1))
        .collect()
}

/// Five copies of one message in one batch, and the batch delivered five times: one
/// effect, the handler ran once, every copy acked, the rest counted as duplicates.
#[tokio::test]
async fn a_message_delivered_five_times_in_batches_has_its_effect_once() {
    let db = db().await;
    let effect = Effect::new(&db);
    let consumer = IdempotentConsumer::new(
        Arc::clone(&db.inbox),
        Pipeline::new().on("OrderPlaced", "projector", effect.clone()),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    let dup = message("OrderPlaced", "1", 1);
    let mut batch = vec![dup.clone(); 5];
    batch.extend(fresh(3));
    for _ in 0..5 {
        assert_eq!(consumer.process_batch(&batch).await, vec![Ack; 8]);
    }
    assert_eq!(db.effects_of(dup.id).await, 1);
    assert_eq!(effect.calls(dup.id), 1, "the handler itself ran once");
    assert_eq!(db.effects("projector").await.len(), 4);
}

/// Two consumers handle overlapping batches at the same time, one in the opposite
/// order, each handler pausing inside its transaction: every message has one effect,
/// every delivery is acked, and the claims (sorted) never deadlock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_racing_on_overlapping_batches_produce_one_effect_each() {
    let db = db().await;
    let make = || {
        let mut e = Effect::new(&db);
        e.pause = Duration::from_millis(5);
        IdempotentConsumer::new(
            Arc::clone(&db.inbox),
            Pipeline::new().on("OrderPlaced", "projector", e),
            ConsumerConfig::new(),
        )
        .expect("valid consumer config")
    };
    let (a, b) = (make(), make());
    for _ in 0..3 {
        let msgs = fresh(20);
        let reversed: Vec<IncomingMessage> = msgs.iter().rev().cloned().collect();
        let (ra, rb) = tokio::join!(a.process_batch(&msgs), b.process_batch(&reversed));
        assert_eq!((ra, rb), (vec![Ack; 20], vec![Ack; 20]));
        for m in &msgs {
            assert_eq!(db.effects_of(m.id).await, 1, "one effect per message");
        }
    }
}

/// One message of a batch of ten fails: the other nine are applied once and acked, the
/// failing one is requeued, its failure counted once (it ran again alone after the
/// batch was rolled back), with no effect; the next delivery applies it.
#[tokio::test]
async fn one_failing_handler_in_a_batch_leaves_the_others_applied_and_is_retried_alone() {
    let db = db().await;
    let msgs = fresh(10);
    let bad = msgs[6].id;
    let effect = Effect::new(&db).failing_on(bad);
    let consumer = IdempotentConsumer::new(
        Arc::clone(&db.inbox),
        Pipeline::new().on("OrderPlaced", "projector", effect.clone()),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    let decisions = consumer.process_batch(&msgs).await;
    let mut want = vec![Ack; 10];
    want[6] = Requeue;
    assert_eq!(decisions, want);
    for m in &msgs {
        let expected = usize::from(m.id != bad);
        assert_eq!(db.effects_of(m.id).await, expected, "{}", m.id);
    }
    assert_eq!(db.failures(bad, "projector").await, Some((1, false)));
    assert_eq!(effect.calls(bad), 2, "in the batch, then alone");
    assert_eq!(
        effect.calls(msgs[9].id),
        1,
        "after the failing one: run once"
    );
    assert_eq!(
        effect.calls(msgs[0].id),
        2,
        "before it: rolled back and run again"
    );
    effect.fails.lock().expect("lock").clear();
    assert_eq!(consumer.process_batch(&msgs).await, vec![Ack; 10]);
    assert_eq!(db.effects_of(bad).await, 1);
    assert_eq!(db.effects("projector").await.len(), 10);
}

/// Two handlers per event type; the second always fails on one message and panics on
/// another. After `max_deliveries` batches each is a consumer dead letter of that
/// handler only (the panic's message in its error), acked; the first handler applied
/// both once; the rest of every batch flowed.
#[tokio::test]
async fn per_handler_dead_letters_in_batch_mode_failures_and_panics() {
    let db = db().await;
    let msgs = fresh(6);
    let (failing, panicking) = (msgs[1].id, msgs[4].id);
    let mut panics = Effect::new(&db).failing_on(panicking);
    panics.panics = true;
    struct Either(Effect, Effect);
    #[async_trait]
    impl Handler<PgInbox> for Either {
        async fn handle(
            &self,
            conn: &mut PgConnection,
            msg: &IncomingMessage,
            ctx: &HandlerContext,
        ) -> Result<(), HandlerError> {
            if self.1.fails.lock().expect("lock").contains(&msg.id) {
                self.1.handle(conn, msg, ctx).await
            } else {
                self.0.handle(conn, msg, ctx).await
            }
        }
    }
    let consumer = IdempotentConsumer::new(
        Arc::clone(&db.inbox),
        Pipeline::new()
            .on("OrderPlaced", "first", Effect::new(&db))
            .on(
                "OrderPlaced",
                "second",
                Either(Effect::new(&db).failing_on(failing), panics),
            ),
        ConsumerConfig::new().with_max_deliveries(3),
    )
    .expect("valid consumer config");
    let mut want = vec![Ack; 6];
    want[1] = Requeue;
    want[4] = Requeue;
    assert_eq!(consumer.process_batch(&msgs).await, want);
    assert_eq!(consumer.process_batch(&msgs).await, want);
    assert_eq!(
        consumer.process_batch(&msgs).await,
        vec![Ack; 6],
        "dead letters are acked"
    );
    let dead = db
        .inbox
        .consumer_dead_letters(None, 10)
        .await
        .expect("dead letters");
    let mut got: Vec<(Uuid, &str, u32)> = dead
        .iter()
        .map(|d| (d.message_id, d.consumer.as_str(), d.attempts))
        .collect();
    got.sort();
    let mut want = vec![(failing, "second", 3), (panicking, "second", 3)];
    want.sort();
    assert_eq!(got, want);
    let panicked = dead
        .iter()
        .find(|d| d.message_id == panicking)
        .expect("the panicking one");
    assert!(
        panicked.last_error.contains("panicked") && panicked.last_error.contains("projection bug"),
        "{}",
        panicked.last_error
    );
    let first = db.effects("first").await;
    assert_eq!(
        first.len(),
        6,
        "the first handler applied each message once"
    );
    assert_eq!(db.effects("second").await.len(), 4);
    // A redelivery of the dead letters is acked without running the handler again.
    assert_eq!(consumer.process_batch(&msgs).await, vec![Ack; 6]);
    assert_eq!(db.effects("second").await.len(), 4);
    assert_eq!(db.failures(failing, "first").await, None);
}

/// A permanent error is dead-lettered at once, in the same batch.
#[tokio::test]
async fn a_permanent_error_in_a_batch_is_dead_lettered_at_once() {
    let db = db().await;
    let msgs = fresh(3);
    let mut effect = Effect::new(&db).failing_on(msgs[0].id);
    effect.permanent = true;
    let consumer = IdempotentConsumer::new(
        Arc::clone(&db.inbox),
        Pipeline::new().on("OrderPlaced", "projector", effect),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    assert_eq!(consumer.process_batch(&msgs).await, vec![Ack; 3]);
    assert_eq!(db.failures(msgs[0].id, "projector").await, Some((1, true)));
    assert_eq!(db.effects("projector").await.len(), 2);
}

/// Records the applied version and stale flag the handler was told.
struct SeesVersion(String);

#[async_trait]
impl Handler<PgInbox> for SeesVersion {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &IncomingMessage,
        ctx: &HandlerContext,
    ) -> Result<(), HandlerError> {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.effects (message_id, consumer, version, stale) VALUES ($1, $2, $3, $4)",
            self.0
        )))
        .bind(msg.id)
        .bind(&ctx.consumer)
        .bind(ctx.applied_version)
        .bind(ctx.stale)
        .execute(&mut *conn)
        .await?;
        Ok(())
    }
}

/// Versions 1, 3, 2 and a re-sent 3 of one aggregate in **one** batch: each sees the
/// versions the messages before it left, so the default policy applies 1 and 3 and
/// skips the rest, `Deliver` delivers all four in order with the last two flagged, and
/// the applied versions the handler is told go 0 → 1 → 3 → 3. Exactly as one message
/// at a time (`tests/inbox.rs`).
#[tokio::test]
async fn versions_inside_a_batch_keep_order_and_the_stale_policy() {
    let db = db().await;
    let consumer = IdempotentConsumer::new(
        Arc::clone(&db.inbox),
        Pipeline::new()
            .on("OrderChanged", "skipper", Effect::new(&db))
            .on_with(
                "OrderChanged",
                "auditor",
                Effect::new(&db),
                StalePolicy::Deliver,
            )
            .on_with(
                "OrderChanged",
                "watcher",
                SeesVersion(db.schema.clone()),
                StalePolicy::Deliver,
            ),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    let batch: Vec<IncomingMessage> = [1, 3, 2, 3]
        .into_iter()
        .map(|v| message("OrderChanged", "42", v))
        .collect();
    assert_eq!(consumer.process_batch(&batch).await, vec![Ack; 4]);
    let versions = |rows: Vec<(Uuid, Option<i64>, bool)>| -> Vec<(Option<i64>, bool)> {
        rows.into_iter().map(|(_, v, s)| (v, s)).collect()
    };
    assert_eq!(
        versions(db.effects("skipper").await),
        [(Some(1), false), (Some(3), false)]
    );
    assert_eq!(
        versions(db.effects("auditor").await),
        [
            (Some(1), false),
            (Some(3), false),
            (Some(2), true),
            (Some(3), true)
        ]
    );
    assert_eq!(
        versions(db.effects("watcher").await),
        [
            (None, false),
            (Some(1), false),
            (Some(3), true),
            (Some(3), true)
        ],
        "the second sees the first's version"
    );
    // The next batch sees what this one recorded.
    let next = message("OrderChanged", "42", 4);
    assert_eq!(
        consumer
            .process_batch(&[next.clone(), message("OrderChanged", "42", 3)])
            .await,
        vec![Ack; 2]
    );
    assert_eq!(db.effects("skipper").await.len(), 3);
    assert_eq!(
        db.effects("watcher").await.last().map(|(_, v, s)| (*v, *s)),
        Some((Some(4), true))
    );
}

/// Batches sharing aggregates, handled concurrently in opposite orders with several
/// handlers: the version rows are locked in one sorted order, so neither batch
/// deadlocks (both commit without a retry) and every version is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_sharing_aggregates_do_not_deadlock() {
    let db = db().await;
    let make = || {
        IdempotentConsumer::new(
            Arc::clone(&db.inbox),
            Pipeline::new()
                .on("OrderChanged", "a", Effect::new(&db))
                .on("OrderChanged", "b", Effect::new(&db)),
            ConsumerConfig::new(),
        )
        .expect("valid consumer config")
    };
    let (x, y) = (make(), make());
    for round in 1..=3 {
        let forward: Vec<IncomingMessage> = (0..20)
            .map(|i| message("OrderChanged", &format!("agg-{i}"), round))
            .collect();
        let backward: Vec<IncomingMessage> = (0..20)
            .rev()
            .map(|i| message("OrderChanged", &format!("agg-{i}"), round + 10))
            .collect();
        let (rx, ry) = tokio::join!(x.process_batch(&forward), y.process_batch(&backward));
        assert_eq!((rx, ry), (vec![Ack; 20], vec![Ack; 20]));
    }
    let highest: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT version FROM {}.inbox_versions ORDER BY consumer, aggregate_id",
        db.schema
    )))
    .fetch_all(&db.pool)
    .await
    .expect("versions");
    assert_eq!(highest.len(), 40);
    assert!(highest.iter().all(|v| *v == 13), "{highest:?}");
    let failures: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {}.inbox_failures",
        db.schema
    )))
    .fetch_one(&db.pool)
    .await
    .expect("failures");
    assert_eq!(failures, 0);
}

/// A set-based handler: one `INSERT … SELECT FROM UNNEST` per call; fails the whole
/// call, naming its index, when one of its messages is listed.
struct SetBased {
    schema: String,
    calls: AtomicU32,
    sizes: Mutex<Vec<usize>>,
    fails: Mutex<Option<Uuid>>,
}

#[async_trait]
impl Handler<PgInbox> for SetBased {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &IncomingMessage,
        ctx: &HandlerContext,
    ) -> Result<(), HandlerError> {
        let one = [(msg, ctx.clone())];
        self.handle_batch(conn, &one)
            .await
            .map_err(BatchHandlerError::into_error)
    }

    async fn handle_batch(
        &self,
        conn: &mut PgConnection,
        msgs: &[(&IncomingMessage, HandlerContext)],
    ) -> Result<(), BatchHandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.sizes.lock().expect("lock").push(msgs.len());
        let fails = *self.fails.lock().expect("lock");
        if let Some(i) = msgs.iter().position(|(m, _)| Some(m.id) == fails) {
            return Err(BatchHandlerError::new(
                i,
                HandlerError::retryable(std::io::Error::other("bad row")),
            ));
        }
        let ids: Vec<Uuid> = msgs.iter().map(|(m, _)| m.id).collect();
        let consumers: Vec<&str> = msgs.iter().map(|(_, c)| c.consumer.as_str()).collect();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}.effects (message_id, consumer, stale)
             SELECT id, consumer, false FROM UNNEST($1::uuid[], $2::text[]) AS u(id, consumer)",
            self.schema
        )))
        .bind(&ids)
        .bind(&consumers)
        .execute(&mut *conn)
        .await
        .map_err(|e| BatchHandlerError::new(0, e.into()))?;
        Ok(())
    }
}

/// A handler overriding `handle_batch` gets the whole batch in one call (duplicates
/// left out); when it names a failing message, that one is requeued and the others
/// are applied (the prefix as a batch again, the failing one alone, the rest as a
/// batch).
#[tokio::test]
async fn a_set_based_handler_gets_the_batch_in_one_call() {
    let db = db().await;
    let handler = Arc::new(SetBased {
        schema: db.schema.clone(),
        calls: AtomicU32::new(0),
        sizes: Mutex::new(Vec::new()),
        fails: Mutex::new(None),
    });
    struct Shared(Arc<SetBased>);
    #[async_trait]
    impl Handler<PgInbox> for Shared {
        async fn handle(
            &self,
            conn: &mut PgConnection,
            msg: &IncomingMessage,
            ctx: &HandlerContext,
        ) -> Result<(), HandlerError> {
            self.0.handle(conn, msg, ctx).await
        }
        async fn handle_batch(
            &self,
            conn: &mut PgConnection,
            msgs: &[(&IncomingMessage, HandlerContext)],
        ) -> Result<(), BatchHandlerError> {
            self.0.handle_batch(conn, msgs).await
        }
    }
    let consumer = IdempotentConsumer::new(
        Arc::clone(&db.inbox),
        Pipeline::new().on("OrderPlaced", "bulk", Shared(Arc::clone(&handler))),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    let msgs = fresh(50);
    let mut batch = msgs.clone();
    batch.push(msgs[0].clone());
    assert_eq!(consumer.process_batch(&batch).await, vec![Ack; 51]);
    assert_eq!(*handler.sizes.lock().expect("lock"), [50], "one call");
    assert_eq!(db.effects("bulk").await.len(), 50);

    let next = fresh(10);
    *handler.fails.lock().expect("lock") = Some(next[3].id);
    handler.sizes.lock().expect("lock").clear();
    let mut want = vec![Ack; 10];
    want[3] = Requeue;
    assert_eq!(consumer.process_batch(&next).await, want);
    assert_eq!(
        *handler.sizes.lock().expect("lock"),
        [10, 3, 1, 6],
        "the batch, the prefix again, the failing one alone, the rest"
    );
    for (i, m) in next.iter().enumerate() {
        assert_eq!(db.effects_of(m.id).await, usize::from(i != 3));
    }
}

/// Handled and unhandled event types in one batch: each unhandled message follows the
/// policy on its own (here recorded as a dead letter under `unhandled`), the others
/// are applied.
#[tokio::test]
async fn unhandled_event_types_in_a_batch_follow_the_policy_per_message() {
    let db = db().await;
    let consumer = IdempotentConsumer::new(
        Arc::clone(&db.inbox),
        Pipeline::new().on("OrderPlaced", "projector", Effect::new(&db)),
        ConsumerConfig::new().with_unhandled(UnhandledPolicy::DeadLetter),
    )
    .expect("valid consumer config");
    let stray = message("OrderShipped", "1", 1);
    let mut batch = fresh(2);
    batch.insert(1, stray.clone());
    assert_eq!(consumer.process_batch(&batch).await, vec![Ack; 3]);
    assert!(
        db.inbox
            .is_dead(stray.id, UNHANDLED_CONSUMER)
            .await
            .expect("dead")
    );
    assert_eq!(db.effects("projector").await.len(), 2);
    let requeue = IdempotentConsumer::new(
        Arc::clone(&db.inbox),
        Pipeline::new().on("OrderPlaced", "projector", Effect::new(&db)),
        ConsumerConfig::new().with_unhandled(UnhandledPolicy::Requeue),
    )
    .expect("valid consumer config");
    let mut batch = fresh(2);
    batch.push(message("OrderShipped", "2", 1));
    assert_eq!(requeue.process_batch(&batch).await, vec![Ack, Ack, Requeue]);
}

/// A pool that hands out no connection: the whole batch is deferred (no delivery
/// spent, no failure counted), by the idempotent consumer and by the durable
/// receiver's batched store; once a connection is free, the batch is applied.
#[tokio::test]
async fn an_unreachable_inbox_defers_the_whole_batch() {
    let db = db().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(200))
        .connect(&database_url())
        .await
        .expect("connect");
    let held = pool.acquire().await.expect("the only connection");
    let starved = Arc::new(
        PgOutbox::new(pool.clone(), &PgConfig::default().with_schema(&db.schema))
            .expect("outbox")
            .inbox(),
    );
    let consumer = IdempotentConsumer::new(
        Arc::clone(&starved),
        Pipeline::new().on("OrderPlaced", "projector", Effect::new(&db)),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    let msgs = fresh(5);
    assert_eq!(consumer.process_batch(&msgs).await, vec![Defer; 5]);
    let receiver = DurableReceiver::new(Arc::clone(&starved));
    assert_eq!(receiver.handle_batch(&msgs).await, vec![Defer; 5]);
    drop(held);
    assert_eq!(consumer.process_batch(&msgs).await, vec![Ack; 5]);
    assert_eq!(db.effects("projector").await.len(), 5);
    assert!(
        db.inbox
            .consumer_dead_letters(None, 10)
            .await
            .expect("dead letters")
            .is_empty()
    );
    let failures: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {}.inbox_failures",
        db.schema
    )))
    .fetch_one(&db.pool)
    .await
    .expect("failures");
    assert_eq!(failures, 0, "the outage counted no failure");
}

/// The batched path counted on the wire (`RoundTripCounter`: each simple query and each
/// extended-protocol `Sync`), for batches of 100 messages with one handler inserting one
/// row each: begin, the batch's claim with its dead-letter checks, the 100 inserts,
/// the check that the transaction is not aborted, commit (plus sqlx's ping when the
/// connection goes back to the pool): about 1.06 round trips per message; with
/// versions, the locked read and the update of the batch's versions add two per batch.
/// Per-message mode: 6 and 8.
#[tokio::test]
async fn a_batch_of_100_takes_about_one_round_trip_per_message() {
    use outboxkit_testkit::pg::RoundTripCounter;
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

    let db = db().await;
    let counter = RoundTripCounter::start("127.0.0.1:5432").await;
    let base: PgConnectOptions = database_url().parse().expect("database URL");
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect_with(counter.options(&base))
        .await
        .expect("connect through the counter");
    let inbox = Arc::new(
        PgOutbox::new(pool, &PgConfig::default().with_schema(&db.schema))
            .expect("outbox")
            .inbox(),
    );
    let consumer = IdempotentConsumer::new(
        Arc::clone(&inbox),
        Pipeline::new().on("OrderPlaced", "projector", Effect::new(&db)),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    let per_message = async |versioned: bool| {
        let make = || {
            fresh(100)
                .into_iter()
                .map(|mut m| {
                    if !versioned {
                        m.aggregate_version = None;
                    }
                    m
                })
                .collect::<Vec<_>>()
        };
        // Warm up: statements prepared, the connection open.
        assert_eq!(consumer.process_batch(&make()).await, vec![Ack; 100]);
        let before = counter.count();
        for _ in 0..5 {
            assert_eq!(consumer.process_batch(&make()).await, vec![Ack; 100]);
        }
        (counter.count() - before) as f64 / 500.0
    };
    let unversioned = per_message(false).await;
    let versioned = per_message(true).await;
    eprintln!(
        "round trips per message in batches of 100: {unversioned} unversioned, {versioned} versioned"
    );
    // 100 inserts + begin, claim, the abort check, commit + the pool's ping, per batch
    // of 100.
    assert!(
        unversioned <= (100.0 + 4.0 + 1.0) / 100.0,
        "{unversioned} round trips per unversioned message"
    );
    assert!(
        versioned <= (100.0 + 6.0 + 1.0) / 100.0,
        "{versioned} round trips per versioned message"
    );
    assert_eq!(db.effects("projector").await.len(), 1_200);
}

async fn store(db: &Db, msgs: &[IncomingMessage]) {
    let receiver = DurableReceiver::new(Arc::clone(&db.inbox));
    assert_eq!(receiver.handle_batch(msgs).await, vec![Ack; msgs.len()]);
}

/// The durable receiver stores a batch in one statement: a message twice in the batch
/// and one stored before are stored once; `store_batch` says which were new.
#[tokio::test]
async fn the_durable_receiver_stores_a_batch_once_per_message() {
    let db = db().await;
    let msgs = fresh(4);
    store(&db, &msgs[..1]).await;
    let batch = vec![
        msgs[0].clone(),
        msgs[1].clone(),
        msgs[2].clone(),
        msgs[1].clone(),
        msgs[3].clone(),
    ];
    assert_eq!(
        db.inbox.store_batch(&batch).await.expect("store"),
        [false, true, true, false, true]
    );
    store(&db, &batch).await;
    let stored: Vec<(Uuid, Vec<u8>, Option<i64>)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT id, payload, aggregate_version FROM {}.inbox_messages ORDER BY seq",
        db.schema
    )))
    .fetch_all(&db.pool)
    .await
    .expect("stored");
    assert_eq!(stored.len(), 4);
    for m in &msgs {
        let row = stored.iter().find(|(id, ..)| *id == m.id).expect("stored");
        assert_eq!((&row.1, row.2), (&m.payload, m.aggregate_version));
    }
}

/// The processor's batched transactions: a batch with a failing message completes the
/// others, schedules a retry of the failing one (one attempt charged) and dead-letters
/// it when attempts run out; the effects of the others are applied once. The same
/// batch processed with one transaction per message gives the same outcomes.
#[tokio::test]
async fn the_processor_batch_with_a_failing_message() {
    for batched in [true, false] {
        let db = db().await;
        let msgs = fresh(8);
        let bad = msgs[2].id;
        store(&db, &msgs).await;
        let retry = RetryPolicy::new()
            .with_base(1.0)
            .with_cap(Duration::from_millis(100))
            .with_jitter(Duration::ZERO)
            .with_max_attempts(2);
        let effect = Effect::new(&db).failing_on(bad);
        let p = InboxProcessor::new(
            Arc::clone(&db.inbox),
            Pipeline::new().on("OrderPlaced", "projector", effect.clone()),
            ProcessorConfig::new()
                .with_retry(retry)
                .with_batch_transactions(batched),
        )
        .expect("valid processor config");
        let first = p.run_once().await.expect("process");
        assert_eq!((first.done, first.retried), (7, 1), "batched: {batched}");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut dead = 0;
        while dead == 0 {
            assert!(tokio::time::Instant::now() < deadline, "never dead");
            tokio::time::sleep(Duration::from_millis(50)).await;
            dead = p.run_once().await.expect("process").dead;
        }
        for m in &msgs {
            assert_eq!(db.effects_of(m.id).await, usize::from(m.id != bad));
        }
        let (status, attempts): (i16, i32) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT status, attempts FROM {}.inbox_messages WHERE id = $1",
            db.schema
        )))
        .bind(bad)
        .fetch_one(&db.pool)
        .await
        .expect("row");
        assert_eq!((status, attempts), (3, 2), "batched: {batched}");
        assert_eq!(
            effect.total_calls(),
            if batched { 3 + 2 + 1 + 5 + 1 } else { 8 + 1 },
            "batched: the batch up to the failing one, the prefix again, the failing one \
             alone, the rest; its retry (a batch of one) alone at once"
        );
    }
}

/// A batch holding version 1 of an aggregate and version 3 (2 missing) for two
/// handlers, and version 1 of another aggregate: the first aggregate's version 1 and
/// the other aggregate are applied, version 3 is deferred (not charged) until 2 is
/// stored, then 2 and 3 are applied in order. Batched transactions: the gap is found
/// before any handler runs and the batch runs again without it.
#[tokio::test]
async fn the_processor_batch_holds_a_gap_and_applies_the_rest() {
    let db = db().await;
    let p = InboxProcessor::new(
        Arc::clone(&db.inbox),
        Pipeline::new()
            .on("OrderChanged", "first", Effect::new(&db))
            .on("OrderChanged", "second", Effect::new(&db)),
        ProcessorConfig::new()
            .with_reorder_window(Duration::from_secs(60), Duration::from_millis(50))
            .with_poll_interval(Duration::from_millis(20)),
    )
    .expect("valid processor config");
    let (v1, v2, v3) = (
        message("OrderChanged", "9", 1),
        message("OrderChanged", "9", 2),
        message("OrderChanged", "9", 3),
    );
    let other = message("OrderChanged", "10", 1);
    store(&db, &[v1.clone(), v3.clone(), other.clone()]).await;
    let r = p.run_once().await.expect("process");
    assert_eq!((r.done, r.deferred), (2, 1), "3 waits for 2");
    store(&db, std::slice::from_ref(&v2)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while db.effects("second").await.len() < 4 {
        assert!(tokio::time::Instant::now() < deadline, "not applied");
        tokio::time::sleep(Duration::from_millis(60)).await;
        p.run_once().await.expect("process");
    }
    for consumer in ["first", "second"] {
        let order: Vec<Uuid> = db
            .effects(consumer)
            .await
            .into_iter()
            .map(|(id, ..)| id)
            .filter(|id| *id != other.id)
            .collect();
        assert_eq!(order, [v1.id, v2.id, v3.id], "{consumer}: version order");
    }
    let attempts: i32 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT attempts FROM {}.inbox_messages WHERE id = $1",
        db.schema
    )))
    .bind(v3.id)
    .fetch_one(&db.pool)
    .await
    .expect("attempts");
    assert_eq!(attempts, 1, "waiting is not charged as an attempt");
}
