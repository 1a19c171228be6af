//! The inbox against the real PostgreSQL (and RabbitMQ for the wiring tests).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use outboxkit_core::RetryPolicy;
use outboxkit_core::consumer::{DeliveryHandler, HandlerDecision};
use outboxkit_core::inbox::ConsumerDeadLetters;
use outboxkit_core::wire::IncomingMessage;
use outboxkit_inbox::{
    ConsumerConfig, DurableReceiver, GapPolicy, Handler, HandlerContext, HandlerError,
    IdempotentConsumer, InboxProcessor, Pipeline, ProcessorConfig, StalePolicy, UNHANDLED_CONSUMER,
    UnhandledPolicy,
};
use outboxkit_postgres::{PgConfig, PgInbox, PgOutbox};
use sqlx::{AssertSqlSafe, PgConnection};
use uuid::Uuid;

mod common;

use common::{Db, database_url, db, message};

/// Writes one effect row per call; fails the first `fail_first` calls; can sleep inside
/// the transaction to widen races.
struct Effect {
    schema: String,
    fail_first: AtomicU32,
    calls: Arc<AtomicU32>,
    permanent: bool,
    pause: Duration,
}

impl Effect {
    fn new(db: &Db) -> Self {
        Self {
            schema: db.schema.clone(),
            fail_first: AtomicU32::new(0),
            calls: Arc::new(AtomicU32::new(0)),
            permanent: false,
            pause: Duration::ZERO,
        }
    }

    fn failing(self, n: u32) -> Self {
        self.fail_first.store(n, Ordering::SeqCst);
        self
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
        self.calls.fetch_add(1, Ordering::SeqCst);
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
        let left = self.fail_first.load(Ordering::SeqCst);
        if left > 0 {
            self.fail_first.store(left - 1, Ordering::SeqCst);
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

#[tokio::test]
async fn a_message_delivered_five_times_has_its_effect_once() {
    let db = db().await;
    let effect = Effect::new(&db);
    let calls = Arc::clone(&effect.calls);
    let consumer = IdempotentConsumer::new(
        Arc::clone(&db.inbox),
        Pipeline::new().on("OrderPlaced", "projector", effect),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    let msg = message("OrderPlaced", "1", 1);
    for _ in 0..5 {
        assert_eq!(consumer.process(&msg).await, HandlerDecision::Ack);
    }
    assert_eq!(db.effects("projector").await.len(), 1);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the handler itself ran once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_racing_on_one_message_produce_one_effect() {
    let db = db().await;
    for _ in 0..5 {
        let msg = message("OrderPlaced", &Uuid::new_v4().to_string(), 1);
        let make = || {
            let mut e = Effect::new(&db);
            e.pause = Duration::from_millis(100);
            IdempotentConsumer::new(
                Arc::clone(&db.inbox),
                Pipeline::new().on("OrderPlaced", "projector", e),
                ConsumerConfig::new(),
            )
            .expect("valid consumer config")
        };
        let (a, b) = (make(), make());
        let (ra, rb) = tokio::join!(a.process(&msg), b.process(&msg));
        assert_eq!((ra, rb), (HandlerDecision::Ack, HandlerDecision::Ack));
        let effects = db.effects("projector").await;
        assert_eq!(
            effects.iter().filter(|(id, ..)| *id == msg.id).count(),
            1,
            "one effect per message"
        );
    }
}

#[tokio::test]
async fn a_handler_that_fails_twice_is_retried_and_applied_once() {
    let db = db().await;
    let consumer = IdempotentConsumer::new(
        Arc::clone(&db.inbox),
        Pipeline::new().on("OrderPlaced", "projector", Effect::new(&db).failing(2)),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    let msg = message("OrderPlaced", "1", 1);
    assert_eq!(consumer.process(&msg).await, HandlerDecision::Requeue);
    assert_eq!(consumer.process(&msg).await, HandlerDecision::Requeue);
    assert_eq!(consumer.process(&msg).await, HandlerDecision::Ack);
    assert_eq!(
        consumer.process(&msg).await,
        HandlerDecision::Ack,
        "a later duplicate is acked"
    );
    assert_eq!(
        db.effects("projector").await.len(),
        1,
        "failed attempts rolled back, success applied once"
    );
    assert!(
        !db.inbox
            .is_dead(msg.id, "projector")
            .await
            .expect("is_dead")
    );
}

#[tokio::test]
async fn after_a_retry_only_the_handlers_that_failed_run_again() {
    let db = db().await;
    let first = Effect::new(&db);
    let second = Effect::new(&db).failing(1);
    let third = Effect::new(&db);
    let (c1, c2, c3) = (
        Arc::clone(&first.calls),
        Arc::clone(&second.calls),
        Arc::clone(&third.calls),
    );
    let consumer = IdempotentConsumer::new(
        Arc::clone(&db.inbox),
        Pipeline::new()
            .on("OrderPlaced", "first", first)
            .on("OrderPlaced", "second", second)
            .on("OrderPlaced", "third", third),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    let msg = message("OrderPlaced", "1", 1);
    assert_eq!(consumer.process(&msg).await, HandlerDecision::Requeue);
    assert_eq!(
        (
            c1.load(Ordering::SeqCst),
            c2.load(Ordering::SeqCst),
            c3.load(Ordering::SeqCst)
        ),
        (1, 1, 0)
    );
    assert_eq!(consumer.process(&msg).await, HandlerDecision::Ack);
    assert_eq!(
        (
            c1.load(Ordering::SeqCst),
            c2.load(Ordering::SeqCst),
            c3.load(Ordering::SeqCst)
        ),
        (1, 2, 1),
        "the first handler is not re-run"
    );
    for consumer in ["first", "second", "third"] {
        assert_eq!(
            db.effects(consumer).await.len(),
            1,
            "{consumer} applied once"
        );
    }
}

#[tokio::test]
async fn stale_versions_are_skipped_or_delivered_flagged_by_policy() {
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
            ),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    // Versions 1, 3, 2 (out of order), then 3 again with a new id (a stale re-send).
    for v in [1, 3, 2, 3] {
        assert_eq!(
            consumer.process(&message("OrderChanged", "42", v)).await,
            HandlerDecision::Ack
        );
    }
    let skipped: Vec<Option<i64>> = db
        .effects("skipper")
        .await
        .into_iter()
        .map(|(_, v, _)| v)
        .collect();
    assert_eq!(
        skipped,
        [Some(1), Some(3)],
        "2 and the second 3 are stale for the default policy"
    );
    let audited: Vec<(Option<i64>, bool)> = db
        .effects("auditor")
        .await
        .into_iter()
        .map(|(_, v, s)| (v, s))
        .collect();
    assert_eq!(
        audited,
        [
            (Some(1), false),
            (Some(3), false),
            (Some(2), true),
            (Some(3), true)
        ]
    );
    // Other aggregates are independent; unversioned messages are never stale.
    assert_eq!(
        consumer.process(&message("OrderChanged", "43", 1)).await,
        HandlerDecision::Ack
    );
    assert_eq!(
        consumer.process(&message("OrderChanged", "43", 0)).await,
        HandlerDecision::Ack
    );
    assert_eq!(db.effects("skipper").await.len(), 4);
}

#[tokio::test]
async fn a_poison_message_becomes_a_dead_letter_and_later_messages_flow() {
    let db = db().await;
    let consumer = IdempotentConsumer::new(
        Arc::clone(&db.inbox),
        Pipeline::new().on(
            "OrderPlaced",
            "projector",
            Effect::new(&db).failing(u32::MAX),
        ),
        ConsumerConfig::new().with_max_deliveries(3),
    )
    .expect("valid consumer config");
    let poison = message("OrderPlaced", "1", 1);
    assert_eq!(consumer.process(&poison).await, HandlerDecision::Requeue);
    assert_eq!(consumer.process(&poison).await, HandlerDecision::Requeue);
    assert_eq!(
        consumer.process(&poison).await,
        HandlerDecision::Ack,
        "acked once it is a dead letter"
    );
    let dead = db
        .inbox
        .consumer_dead_letters(Some("projector"), 10)
        .await
        .expect("list");
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].message_id, dead[0].attempts), (poison.id, 3));
    assert!(dead[0].last_error.contains("injected failure"));
    assert_eq!(dead[0].payload, br#"{"ok":true}"#);
    // A redelivery of the dead letter is acked without running the handler again.
    assert_eq!(consumer.process(&poison).await, HandlerDecision::Ack);
    assert!(db.effects("projector").await.is_empty());
}

#[tokio::test]
async fn a_permanent_error_is_dead_lettered_at_once() {
    let db = db().await;
    let mut effect = Effect::new(&db).failing(1);
    effect.permanent = true;
    let consumer = IdempotentConsumer::new(
        Arc::clone(&db.inbox),
        Pipeline::new().on("OrderPlaced", "projector", effect),
        ConsumerConfig::new(),
    )
    .expect("valid consumer config");
    let msg = message("OrderPlaced", "1", 1);
    assert_eq!(consumer.process(&msg).await, HandlerDecision::Ack);
    assert!(
        db.inbox
            .is_dead(msg.id, "projector")
            .await
            .expect("is_dead")
    );
}

fn processor(
    db: &Db,
    pipeline: Pipeline<PgInbox>,
    config: ProcessorConfig,
) -> InboxProcessor<PgInbox> {
    InboxProcessor::new(
        Arc::clone(&db.inbox),
        pipeline,
        config.with_poll_interval(Duration::from_millis(50)),
    )
    .expect("valid processor config")
}

async fn store(db: &Db, msg: &IncomingMessage) {
    let receiver = DurableReceiver::new(Arc::clone(&db.inbox));
    assert_eq!(receiver.handle(msg).await, HandlerDecision::Ack);
}

#[tokio::test]
async fn durable_inbox_stores_once_and_processes_once() {
    let db = db().await;
    let msg = message("OrderPlaced", "1", 1);
    for _ in 0..3 {
        store(&db, &msg).await; // duplicates are absorbed on store
    }
    let p = processor(
        &db,
        Pipeline::new().on("OrderPlaced", "projector", Effect::new(&db)),
        ProcessorConfig::new(),
    );
    let report = p.run_once().await.expect("process");
    assert_eq!((report.claimed, report.done), (1, 1));
    assert_eq!(p.run_once().await.expect("process").claimed, 0);
    assert_eq!(db.effects("projector").await.len(), 1);
}

/// An invalid setting is refused where the processor is built, with the typed error
/// naming it: nothing is claimed.
#[tokio::test]
async fn an_invalid_processor_config_is_refused_where_the_processor_is_built() {
    let db = db().await;
    let msg = message("OrderPlaced", "1", 1);
    store(&db, &msg).await;
    for (config, expected) in [
        (ProcessorConfig::new().with_batch_size(0), "batch_size"),
        (ProcessorConfig::new().with_lease(Duration::ZERO), "lease"),
        (
            ProcessorConfig::new().with_reorder_window(Duration::from_secs(1), Duration::ZERO),
            "reorder_window",
        ),
    ] {
        let err = InboxProcessor::new(
            Arc::clone(&db.inbox),
            Pipeline::new().on("OrderPlaced", "projector", Effect::new(&db)),
            config,
        )
        .expect_err("refused");
        assert!(
            matches!(&err, outboxkit_core::OutboxError::InvalidConfig { field, .. } if *field == expected),
            "{err}"
        );
    }
    let p = processor(
        &db,
        Pipeline::new().on("OrderPlaced", "projector", Effect::new(&db)),
        ProcessorConfig::new(),
    );
    let report = p.run_once().await.expect("process");
    assert_eq!(
        (report.claimed, report.done),
        (1, 1),
        "the message waited, unclaimed"
    );
}

/// `max_deliveries` 0 is refused where the consumer is built (it used to be raised to 1
/// silently), with the typed error naming it.
#[tokio::test]
async fn an_invalid_consumer_config_is_refused_where_the_consumer_is_built() {
    let db = db().await;
    let err = IdempotentConsumer::new(
        Arc::clone(&db.inbox),
        Pipeline::new().on("OrderPlaced", "projector", Effect::new(&db)),
        ConsumerConfig::new().with_max_deliveries(0),
    )
    .expect_err("refused");
    assert!(
        matches!(
            &err,
            outboxkit_core::OutboxError::InvalidConfig {
                field: "max_deliveries",
                ..
            }
        ),
        "{err}"
    );
    let config = ConsumerConfig::new()
        .with_max_deliveries(1)
        .with_unhandled(UnhandledPolicy::DeadLetter);
    assert_eq!(
        (config.max_deliveries(), config.unhandled()),
        (1, UnhandledPolicy::DeadLetter)
    );
    assert!(config.validate().is_ok());
}

/// `with_retry` takes `RetryPolicies` as the dispatcher does: an event type's override
/// applies to its messages only.
#[tokio::test]
async fn durable_inbox_retry_policies_apply_by_event_type() {
    let db = db().await;
    let placed = message("OrderPlaced", "1", 1);
    let shipped = message("OrderShipped", "2", 1);
    store(&db, &placed).await;
    store(&db, &shipped).await;
    let quick = RetryPolicy::new()
        .with_base(1.0)
        .with_cap(Duration::from_millis(10))
        .with_jitter(Duration::ZERO);
    let retry = outboxkit_core::RetryPolicies::new(quick.clone().with_max_attempts(5))
        .with_override("OrderShipped", quick.with_max_attempts(1));
    let p = processor(
        &db,
        Pipeline::new()
            .on("OrderPlaced", "projector", Effect::new(&db).failing(100))
            .on("OrderShipped", "shipper", Effect::new(&db).failing(100)),
        ProcessorConfig::new().with_retry(retry),
    );
    let first = p.run_once().await.expect("process");
    assert_eq!(
        (first.retried, first.dead),
        (1, 1),
        "OrderShipped's single attempt is final, OrderPlaced is retried"
    );
}

#[tokio::test]
async fn durable_inbox_retries_with_backoff_then_dead_letters() {
    let db = db().await;
    let ok = message("OrderPlaced", "1", 1);
    let poison = message("OrderPlaced", "2", 1);
    store(&db, &ok).await;
    store(&db, &poison).await;
    struct FailsFor(Uuid, Effect);
    #[async_trait]
    impl Handler<PgInbox> for FailsFor {
        async fn handle(
            &self,
            conn: &mut PgConnection,
            msg: &IncomingMessage,
            ctx: &HandlerContext,
        ) -> Result<(), HandlerError> {
            if msg.id == self.0 {
                return Err(HandlerError::retryable(std::io::Error::other(
                    "always fails",
                )));
            }
            self.1.handle(conn, msg, ctx).await
        }
    }
    let retry = RetryPolicy::new()
        .with_base(1.0)
        .with_cap(Duration::from_millis(100))
        .with_jitter(Duration::ZERO)
        .with_max_attempts(3);
    let p = processor(
        &db,
        Pipeline::new().on(
            "OrderPlaced",
            "projector",
            FailsFor(poison.id, Effect::new(&db)),
        ),
        ProcessorConfig::new().with_retry(retry),
    );
    let first = p.run_once().await.expect("process");
    assert_eq!(
        (first.done, first.retried),
        (1, 1),
        "the poison message does not block the good one"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut dead = 0;
    while dead == 0 && tokio::time::Instant::now() < deadline {
        dead = p.run_once().await.expect("process").dead;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(dead, 1);
    let (status, attempts, error): (i16, i32, String) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT status, attempts, last_error FROM {}.inbox_messages WHERE id = $1",
        db.schema
    )))
    .bind(poison.id)
    .fetch_one(&db.pool)
    .await
    .expect("row");
    assert_eq!((status, attempts), (3, 3));
    assert!(
        error.contains("attempts exhausted (3/3)") && error.contains("projector"),
        "{error}"
    );
}

#[tokio::test]
async fn durable_inbox_holds_a_message_ahead_of_a_gap_for_its_predecessor() {
    let db = db().await;
    let p = processor(
        &db,
        Pipeline::new().on("OrderChanged", "projector", Effect::new(&db)),
        ProcessorConfig::new()
            .with_reorder_window(Duration::from_secs(60), Duration::from_millis(100)),
    );
    let (v1, v2, v3) = (
        message("OrderChanged", "9", 1),
        message("OrderChanged", "9", 2),
        message("OrderChanged", "9", 3),
    );
    store(&db, &v1).await;
    store(&db, &v3).await;
    let r = p.run_once().await.expect("process");
    assert_eq!((r.done, r.deferred), (1, 1), "3 waits for 2");
    store(&db, &v2).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while db.effects("projector").await.len() < 3 && tokio::time::Instant::now() < deadline {
        p.run_once().await.expect("process");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let order: Vec<Option<i64>> = db
        .effects("projector")
        .await
        .into_iter()
        .map(|(_, v, _)| v)
        .collect();
    assert_eq!(
        order,
        [Some(1), Some(2), Some(3)],
        "applied in version order"
    );
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

#[tokio::test]
async fn after_the_reorder_window_a_gap_is_processed_anyway_or_dead_lettered() {
    for (policy, expect_applied) in [
        (GapPolicy::ProcessAnyway, true),
        (GapPolicy::DeadLetter, false),
    ] {
        let db = db().await;
        let p = processor(
            &db,
            Pipeline::new().on("OrderChanged", "projector", Effect::new(&db)),
            ProcessorConfig::new()
                .with_reorder_window(Duration::from_millis(300), Duration::from_millis(100))
                .with_gap_policy(policy),
        );
        store(&db, &message("OrderChanged", "9", 1)).await;
        let v3 = message("OrderChanged", "9", 3);
        store(&db, &v3).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let mut finished = false;
        while !finished && tokio::time::Instant::now() < deadline {
            let r = p.run_once().await.expect("process");
            finished = r.dead > 0 || db.effects("projector").await.len() == 2;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let applied = db
            .effects("projector")
            .await
            .iter()
            .any(|(id, ..)| *id == v3.id);
        assert_eq!(applied, expect_applied, "{policy:?}");
        if !expect_applied {
            let status: i16 = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT status FROM {}.inbox_messages WHERE id = $1",
                db.schema
            )))
            .bind(v3.id)
            .fetch_one(&db.pool)
            .await
            .expect("status");
            assert_eq!(status, 3, "dead");
        }
    }
}

/// A handler that blocks forever on one message: the processor holding it is killed.
struct Hangs(Effect);

#[async_trait]
impl Handler<PgInbox> for Hangs {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        msg: &IncomingMessage,
        ctx: &HandlerContext,
    ) -> Result<(), HandlerError> {
        self.0.handle(conn, msg, ctx).await?;
        std::future::pending::<()>().await;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_processor_killed_mid_batch_loses_nothing() {
    let db = db().await;
    let msgs: Vec<IncomingMessage> = (0..20)
        .map(|i| message("OrderPlaced", &i.to_string(), 1))
        .collect();
    for m in &msgs {
        store(&db, m).await;
    }
    let doomed = processor(
        &db,
        Pipeline::new().on("OrderPlaced", "projector", Hangs(Effect::new(&db))),
        ProcessorConfig::new()
            .with_batch_size(10)
            .with_lease(Duration::from_secs(1)),
    );
    let killed = tokio::spawn(async move { doomed.run_once().await });
    // Wait until it has claimed its batch (and hangs on the first message), then kill it.
    let claimed = format!(
        "SELECT count(*) FROM {}.inbox_messages WHERE status = 9",
        db.schema
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sqlx::query_scalar::<_, i64>(AssertSqlSafe(claimed.clone()))
        .fetch_one(&db.pool)
        .await
        .expect("count")
        < 10
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the doomed processor never claimed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    killed.abort();

    let rescuer = processor(
        &db,
        Pipeline::new().on("OrderPlaced", "projector", Effect::new(&db)),
        ProcessorConfig::new(),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while db.effects("projector").await.len() < 20 && tokio::time::Instant::now() < deadline {
        rescuer.run_once().await.expect("process");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let effects = db.effects("projector").await;
    assert_eq!(
        effects.len(),
        20,
        "every message applied after the lease expired"
    );
    let distinct: std::collections::HashSet<Uuid> = effects.iter().map(|(id, ..)| *id).collect();
    assert_eq!(
        distinct.len(),
        20,
        "each exactly once (the killed transaction rolled back)"
    );
}

#[tokio::test]
async fn retention_purges_old_records_and_processed_messages() {
    let db = db().await;
    let msg = message("OrderPlaced", "1", 1);
    store(&db, &msg).await;
    let p = processor(
        &db,
        Pipeline::new().on("OrderPlaced", "projector", Effect::new(&db)),
        ProcessorConfig::new(),
    );
    p.run_once().await.expect("process");
    let keep = outboxkit_inbox::InboxRetention::new();
    assert_eq!(
        keep.purge(&*db.inbox).await.expect("purge"),
        outboxkit_inbox::PurgeReport::default(),
        "recent rows are kept"
    );
    let purge_all = outboxkit_inbox::InboxRetention::new()
        .with_dedup_window(Duration::ZERO)
        .with_processed_retention(Duration::ZERO)
        .with_batch_size(1);
    let report = purge_all.purge(&*db.inbox).await.expect("purge");
    assert_eq!((report.inbox_records, report.processed_messages), (1, 1));
}

/// A message whose event type no handler subscribes to follows the consumer's policy:
/// `Ack` (the default) acknowledges it and records nothing; `DeadLetter` records it as a
/// consumer dead letter under `unhandled` (payload kept) and acknowledges it; `Requeue`
/// leaves it to the broker. The durable inbox follows the same policy: done, `Dead`
/// with a reason, or tried again later without an attempt counted.
#[tokio::test]
async fn an_unhandled_event_type_follows_the_policy() {
    let db = db().await;
    let pipeline = || Pipeline::new().on("OrderPlaced", "projector", Effect::new(&db));
    let msg = message("OrderShipped", "1", 1);

    let ack = IdempotentConsumer::new(Arc::clone(&db.inbox), pipeline(), ConsumerConfig::new())
        .expect("valid consumer config");
    assert_eq!(ack.process(&msg).await, HandlerDecision::Ack);
    assert!(
        !db.inbox
            .is_dead(msg.id, UNHANDLED_CONSUMER)
            .await
            .expect("dead")
    );

    let requeue = IdempotentConsumer::new(
        Arc::clone(&db.inbox),
        pipeline(),
        ConsumerConfig::new().with_unhandled(UnhandledPolicy::Requeue),
    )
    .expect("valid consumer config");
    assert_eq!(requeue.process(&msg).await, HandlerDecision::Requeue);
    assert!(
        !db.inbox
            .is_dead(msg.id, UNHANDLED_CONSUMER)
            .await
            .expect("dead")
    );

    let dead = IdempotentConsumer::new(
        Arc::clone(&db.inbox),
        pipeline(),
        ConsumerConfig::new().with_unhandled(UnhandledPolicy::DeadLetter),
    )
    .expect("valid consumer config");
    assert_eq!(dead.process(&msg).await, HandlerDecision::Ack);
    let letters = db
        .inbox
        .consumer_dead_letters(Some(UNHANDLED_CONSUMER), 10)
        .await
        .expect("dead letters");
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].message_id, msg.id);
    assert_eq!(letters[0].payload, msg.payload);
    assert!(
        letters[0].last_error.contains("OrderShipped"),
        "{}",
        letters[0].last_error
    );
    assert!(db.effects("projector").await.is_empty(), "no handler ran");

    // The durable inbox, each policy on a message of its own.
    for (policy, want) in [
        (UnhandledPolicy::Ack, "done"),
        (UnhandledPolicy::DeadLetter, "dead"),
        (UnhandledPolicy::Requeue, "deferred"),
    ] {
        let msg = message("OrderShipped", &Uuid::new_v4().to_string(), 1);
        store(&db, &msg).await;
        let processor = InboxProcessor::new(
            Arc::clone(&db.inbox),
            pipeline(),
            ProcessorConfig::new().with_unhandled(policy),
        )
        .expect("valid processor config");
        let report = processor.run_once().await.expect("process");
        let got = match (report.done, report.dead, report.deferred) {
            (1, 0, 0) => "done",
            (0, 1, 0) => "dead",
            (0, 0, 1) => "deferred",
            _ => "unexpected",
        };
        assert_eq!(got, want, "{policy:?}: {report:?}");
    }
}

/// A handler that panics fails like one that returns an error: counted, retried, and
/// after `max_deliveries` a consumer dead letter whose error carries the panic message.
#[tokio::test]
async fn a_panicking_handler_is_a_counted_failure_then_a_dead_letter() {
    struct Panics;
    #[async_trait]
    impl Handler<PgInbox> for Panics {
        async fn handle(
            &self,
            _: &mut PgConnection,
            _: &IncomingMessage,
            _: &HandlerContext,
        ) -> Result<(), HandlerError> {
            panic!("projection bug (expected by the test)");
        }
    }
    let db = db().await;
    let consumer = IdempotentConsumer::new(
        Arc::clone(&db.inbox),
        Pipeline::new().on("OrderPlaced", "projector", Panics),
        ConsumerConfig::new().with_max_deliveries(2),
    )
    .expect("valid consumer config");
    let msg = message("OrderPlaced", "1", 1);
    assert_eq!(consumer.process(&msg).await, HandlerDecision::Requeue);
    assert_eq!(consumer.process(&msg).await, HandlerDecision::Ack);
    let letters = db
        .inbox
        .consumer_dead_letters(Some("projector"), 10)
        .await
        .expect("dead letters");
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].attempts, 2);
    assert!(
        letters[0]
            .last_error
            .contains("the handler panicked: projection bug"),
        "{}",
        letters[0].last_error
    );
}

/// A store that cannot be reached is never the message's fault: the idempotent
/// consumer and the durable receiver answer `Defer` (hold the delivery and try again),
/// not `Requeue`, so no delivery attempt is spent on an outage.
#[tokio::test]
async fn an_unreachable_inbox_defers_the_delivery() {
    let db = db().await;
    // A pool of one connection, which the test holds: every acquire times out.
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
    let msg = message("OrderPlaced", "1", 1);
    assert_eq!(consumer.process(&msg).await, HandlerDecision::Defer);
    let receiver = DurableReceiver::new(Arc::clone(&starved));
    assert_eq!(receiver.handle(&msg).await, HandlerDecision::Defer);
    drop(held);
    assert_eq!(consumer.process(&msg).await, HandlerDecision::Ack);
    assert_eq!(db.effects("projector").await.len(), 1);
    assert!(
        db.inbox
            .consumer_dead_letters(None, 10)
            .await
            .expect("dead letters")
            .is_empty(),
        "the outage counted no failure"
    );
}

/// The idempotent consumer's per-message path, counted on the wire (a proxy counts each
/// simple query and each extended-protocol `Sync` the client sends): begin, the claim
/// with its dead-letter check, the handler's insert, the check that the handler did not
/// leave the transaction aborted (`SELECT 1`), commit: 5 round trips of ours for an
/// unversioned message, 7 with version tracking (the locked version read and its
/// update), plus the ping sqlx's pool always sends when a connection comes back, on a
/// pool that does not also ping before each acquire (`test_before_acquire(false)`, as
/// `PgOutbox::connect` builds it). Before the round-trip work: 9 and 12; before the
/// abort check: 4 and 6.
#[tokio::test]
async fn the_per_message_path_takes_five_round_trips() {
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
        let make = |n: usize| {
            let mut m = message("OrderPlaced", &format!("agg-{n}-{versioned}"), 1);
            if !versioned {
                m.aggregate_version = None;
            }
            m
        };
        // Warm up: statements prepared, the connection open.
        assert_eq!(consumer.process(&make(1_000)).await, HandlerDecision::Ack);
        let before = counter.count();
        for n in 0..50 {
            assert_eq!(consumer.process(&make(n)).await, HandlerDecision::Ack);
        }
        (counter.count() - before) as f64 / 50.0
    };
    let unversioned = per_message(false).await;
    let versioned = per_message(true).await;
    eprintln!("round trips per message: {unversioned} unversioned, {versioned} versioned");
    // Ours, plus the ping sqlx's pool always sends when a connection is returned.
    assert!(
        unversioned <= 5.0 + 1.0,
        "{unversioned} round trips per unversioned message"
    );
    assert!(
        versioned <= 7.0 + 1.0,
        "{versioned} round trips per versioned message"
    );
    assert_eq!(db.effects("projector").await.len(), 102);
}
