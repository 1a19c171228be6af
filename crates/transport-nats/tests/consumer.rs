//! `NatsConsumer` against the real NATS server, for what only JetStream has or what
//! needs PostgreSQL: redeliveries absorbed by the inbox of outboxkit-postgres, a
//! `max_deliver` limit, a consumer configuration the server refuses. Requeue, reject,
//! undecodable messages, panics, shutdown and resume are properties of the transport
//! conformance suite (`tests/conformance.rs`).

mod common;

use outboxkit_core::Consumer as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{EventPublisher, InboxStore, OutboxMessage};
use outboxkit_nats::{
    DeliveryHandler, HandlerDecision, NatsConsumer, NatsConsumerConfig, NatsError, NatsPublisher,
};
use outboxkit_postgres::{PgInbox, PgOutbox};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use common::*;

/// What a handler saw of one delivery.
#[derive(Debug, Clone)]
struct Seen {
    id: Uuid,
    event_type: String,
    redelivered: bool,
    delivery_count: Option<u64>,
}

struct Running {
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), NatsError>>,
}

impl Running {
    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(DEADLINE, self.task)
            .await
            .expect("consumer stops before the deadline")
            .expect("consumer task did not panic")
            .expect("consumer ends without error");
    }
}

fn start<H: DeliveryHandler>(consumer: NatsConsumer, handler: H) -> Running {
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    let task = tokio::spawn(async move { consumer.run(handler, token).await });
    Running { shutdown, task }
}

fn consumer(fx: &Fixture, durable: &str) -> NatsConsumerConfig {
    NatsConsumerConfig::new(fx.build(), &fx.stream, durable)
        .with_nak_delays(vec![Duration::from_millis(50)])
        .with_reconnect_backoff(Duration::from_millis(100), Duration::from_secs(1))
}

async fn publish(fx: &Fixture, messages: &[OutboxMessage]) {
    let publisher = NatsPublisher::connect(fx.build()).await.expect("connect");
    let outcomes = publisher.publish_batch(messages).await;
    for outcome in &outcomes {
        assert!(outcome.is_published(), "{outcome:?}");
    }
    publisher.close().await;
}

/// The idempotent-consumer pattern on the inbox: claim `(message_id, consumer)`, apply
/// the effect, commit; the first delivery of every message "crashes" after the commit
/// and before the ack (answers `Requeue`), so every message is delivered again.
struct InboxProjector {
    inbox: PgInbox,
    schema: String,
    seen: Mutex<Vec<Seen>>,
    duplicates: Mutex<u32>,
}

impl InboxProjector {
    async fn apply(&self, msg: &IncomingMessage) -> Result<bool, Box<dyn std::error::Error>> {
        let mut tx = self.inbox.begin().await?;
        if !self.inbox.try_claim(&mut tx, msg.id, "projector").await? {
            tx.rollback().await?;
            return Ok(false);
        }
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {}.effects (message_id, applied) VALUES ($1, 1)
             ON CONFLICT (message_id) DO UPDATE SET applied = effects.applied + 1",
            self.schema
        )))
        .bind(msg.id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(true)
    }
}

#[async_trait]
impl DeliveryHandler for InboxProjector {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        self.seen.lock().expect("lock").push(Seen {
            id: msg.id,
            event_type: msg.event_type.clone(),
            redelivered: msg.redelivered,
            delivery_count: msg.delivery_count,
        });
        match self.apply(msg).await {
            // Committed, then "crash" before the ack: JetStream delivers it again.
            Ok(true) => HandlerDecision::Requeue,
            Ok(false) => {
                *self.duplicates.lock().expect("lock") += 1;
                HandlerDecision::Ack
            }
            Err(e) => panic!("projection failed: {e}"),
        }
    }
}

async fn effects_table(outbox: &PgOutbox) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {}.effects (message_id uuid PRIMARY KEY, applied integer NOT NULL)",
        outbox.schema()
    )))
    .execute(outbox.pool())
    .await
    .expect("effects table");
}

/// Every message is delivered twice (the first answer is a nak after the commit), yet
/// each has exactly one effect: the redelivery is flagged (`redelivered`, delivery
/// count 2) and the inbox claim turns it into an acked duplicate. Afterwards nothing is
/// pending on the consumer.
#[tokio::test]
async fn redelivered_messages_have_one_effect_through_the_inbox() {
    let fx = Fixture::new().await;
    let outbox = fresh_outbox().await;
    effects_table(&outbox).await;
    let projector = Arc::new(InboxProjector {
        inbox: outbox.inbox(),
        schema: outbox.schema().to_owned(),
        seen: Mutex::new(Vec::new()),
        duplicates: Mutex::new(0),
    });
    let messages: Vec<OutboxMessage> = (0..20)
        .map(|i| message("OrderPlaced", &i.to_string(), &format!(r#"{{"n":{i}}}"#)))
        .collect();
    publish(&fx, &messages).await;

    let running = start(
        NatsConsumer::new(consumer(&fx, "projector")).expect("valid"),
        Arc::clone(&projector),
    );
    eventually("every message is delivered twice", || async {
        *projector.duplicates.lock().expect("lock") >= 20
    })
    .await;
    eventually("nothing is pending on the consumer", || async {
        let info = fx.consumer_info("projector").await;
        info.num_ack_pending == 0 && info.num_pending == 0
    })
    .await;
    running.stop().await;

    let seen = projector.seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 40, "{seen:?}");
    for msg in &messages {
        let deliveries: Vec<&Seen> = seen.iter().filter(|s| s.id == msg.id).collect();
        assert_eq!(deliveries.len(), 2, "{deliveries:?}");
        assert!(deliveries.iter().all(|s| s.event_type == "OrderPlaced"));
        assert_eq!(
            (deliveries[0].redelivered, deliveries[0].delivery_count),
            (false, Some(1))
        );
        assert_eq!(
            (deliveries[1].redelivered, deliveries[1].delivery_count),
            (true, Some(2))
        );
    }
    let (rows, once): (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT count(*), count(*) FILTER (WHERE applied = 1) FROM {}.effects",
        outbox.schema()
    )))
    .fetch_one(outbox.pool())
    .await
    .expect("effects");
    assert_eq!((rows, once), (20, 20), "one effect per message");
    fx.cleanup().await;
}

/// Requeues one message every time, acks the rest; records every delivery.
#[derive(Clone, Default)]
struct Poisoned {
    poison: Arc<Mutex<Option<Uuid>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

#[async_trait]
impl DeliveryHandler for Poisoned {
    async fn handle(&self, msg: &IncomingMessage) -> HandlerDecision {
        self.seen.lock().expect("lock").push(Seen {
            id: msg.id,
            event_type: msg.event_type.clone(),
            redelivered: msg.redelivered,
            delivery_count: msg.delivery_count,
        });
        if *self.poison.lock().expect("lock") == Some(msg.id) {
            HandlerDecision::Requeue
        } else {
            HandlerDecision::Ack
        }
    }
}

/// With a `max_deliver` set (the default is none), a message a raw handler keeps
/// requeueing is delivered `max_deliver` times, then JetStream stops delivering it
/// (nothing stays pending; the consumer itself never terminates it), and it does not
/// block the messages behind it even with a concurrency of 1. (The inbox records such a
/// message as a consumer dead letter before; see `tests/inbox.rs`.)
#[tokio::test]
async fn with_a_max_deliver_a_requeued_message_stops_after_it_and_blocks_nothing() {
    let fx = Fixture::new().await;
    let poison = message("Poison", "p", "{}");
    let after: Vec<OutboxMessage> = (0..5)
        .map(|i| message("Fine", &i.to_string(), "{}"))
        .collect();
    let mut all = vec![poison.clone()];
    all.extend(after.iter().cloned());
    publish(&fx, &all).await;

    let handler = Poisoned::default();
    *handler.poison.lock().expect("lock") = Some(poison.id);
    let running = start(
        NatsConsumer::new(
            consumer(&fx, "poisoned")
                .with_concurrency(1)
                .with_max_deliver(Some(3)),
        )
        .expect("valid"),
        handler.clone(),
    );
    eventually("every later message is handled", || async {
        let seen = handler.seen.lock().expect("lock");
        after.iter().all(|m| seen.iter().any(|s| s.id == m.id))
    })
    .await;
    eventually(
        "the poison message is no longer pending anywhere",
        || async {
            let info = fx.consumer_info("poisoned").await;
            info.num_ack_pending == 0 && info.num_pending == 0
        },
    )
    .await;
    running.stop().await;

    let seen = handler.seen.lock().expect("lock").clone();
    let poison_deliveries: Vec<Option<u64>> = seen
        .iter()
        .filter(|s| s.id == poison.id)
        .map(|s| s.delivery_count)
        .collect();
    assert_eq!(poison_deliveries, [Some(1), Some(2), Some(3)]);
    for m in &after {
        assert_eq!(seen.iter().filter(|s| s.id == m.id).count(), 1);
    }
    fx.cleanup().await;
}

/// A filter subject outside the stream's subjects cannot be fixed by retrying: `run`
/// returns a typed, permanent error instead of looping.
#[tokio::test]
async fn invalid_consumer_settings_are_a_permanent_error() {
    let fx = Fixture::new().await;
    let consumer = NatsConsumer::new(consumer(&fx, "misfit").with_filter_subject("elsewhere.>"))
        .expect("valid locally");
    let result = tokio::time::timeout(
        DEADLINE,
        consumer.run(Poisoned::default(), CancellationToken::new()),
    )
    .await
    .expect("returns instead of retrying forever");
    match result {
        Err(e @ NatsError::Consumer { .. }) => {
            assert_eq!(e.kind(), outboxkit_core::ErrorKind::Permanent, "{e}");
        }
        other => panic!("expected a permanent Consumer error, got {other:?}"),
    }
    fx.cleanup().await;
}

/// A consumer built `with_stream_setup` creates its missing stream before its durable,
/// as a RabbitMQ consumer declares its queue: what the relay then publishes is captured
/// and consumed. An existing stream keeps its own settings, and a setup naming another
/// stream is refused before anything connects.
#[tokio::test]
async fn a_stream_setup_creates_the_missing_stream_and_leaves_an_existing_one() {
    let fx = Fixture::unconfigured().await;
    let config = fx.build();
    let setup = || outboxkit_nats::StreamSetup::for_config(&fx.stream, &config);
    let creator = NatsConsumer::new(
        consumer(&fx, "creator").with_stream_setup(setup().with_max_age(Duration::from_secs(3600))),
    )
    .expect("valid");
    creator
        .declare()
        .await
        .expect("creates the stream and the durable");
    let mut stream = fx
        .js
        .get_stream(&fx.stream)
        .await
        .expect("the stream exists");
    let info = stream.info().await.expect("stream info");
    assert_eq!(info.config.subjects, vec![format!("{}.>", fx.prefix)]);
    assert_eq!(info.config.max_age, Duration::from_secs(3600));

    // Created again by another consumer with other settings: left as it is.
    let second = NatsConsumer::new(
        consumer(&fx, "second").with_stream_setup(setup().with_max_age(Duration::from_secs(600))),
    )
    .expect("valid");
    second.declare().await.expect("the existing stream is used");
    let info = stream.info().await.expect("stream info");
    assert_eq!(
        info.config.max_age,
        Duration::from_secs(3600),
        "settings untouched"
    );

    // Published after the declare, consumed by the durable it created.
    let handler = Poisoned::default();
    let seen = Arc::clone(&handler.seen);
    let running = start(creator, handler);
    let messages: Vec<_> = (0..3)
        .map(|i| message("Created", &i.to_string(), "{}"))
        .collect();
    publish(&fx, &messages).await;
    eventually("the three messages are consumed", || {
        let n = seen.lock().expect("lock").len();
        async move { n == 3 }
    })
    .await;
    running.stop().await;

    let misnamed = NatsConsumer::new(
        consumer(&fx, "misnamed")
            .with_stream_setup(outboxkit_nats::StreamSetup::for_config("OTHER", &config)),
    );
    match misnamed {
        Err(NatsError::InvalidConfig { field, .. }) => assert_eq!(field, "stream_setup"),
        other => panic!("expected InvalidConfig for stream_setup, got {other:?}"),
    }
    fx.cleanup().await;
}
