//! The WAL relay (`outboxkit_postgres::wal::WalRelay`, feature `wal`) under broker faults
//! injected for real on the shared RabbitMQ, at a precise point of a batch.
//!
//! - One destination's queue full (`x-max-length` with `reject-publish`) refuses a
//!   message, and a memory alarm raised right after makes the rest of the same batch
//!   meet an outage, among them a later message of the refused message's key and one
//!   for the full destination. Once the alarm is cleared and the full queue is gone, every
//!   message is published: no key is left registered as "in the stream" (where the
//!   sweeper of parked rows never touches it, nor tries the refusing destination). Found by `cargo xtask chaos -- --source wal` in CI (seed
//!   13427967000872470842: 40 rows parked for good, 20 side events never published).
//! - PostgreSQL stopped (fast shutdown) while a batch is being published: the relay
//!   cannot record its outcomes, and a server shutting down waits for the relay's
//!   replication session. The relay ends it once recording has failed for 3 s, so the
//!   stop completes in well under the pool's 10 s acquire timeout (a retry waiting
//!   for a connection stretched it to 13 s; found by `cargo xtask chaos -- --source
//!   wal`). After the restart every message is sent.
//!
//! And faults of the slot and its publication, as an operator meets them (the relay
//! must stop with a typed error that says how to start over, never retry for ever, and
//! lose nothing: the rows it did not publish stay pending in the table):
//! - the slot invalidated by PostgreSQL (`max_slot_wal_keep_size` passed, a
//!   checkpoint: `wal_status = 'lost'`) while no relay reads it;
//! - the WAL segment the slot restarts from deleted from `pg_wal` (the slot still
//!   `reserved`: the server answers SQLSTATE 58P01);
//! - the publication dropped and created again under a running relay, with a row
//!   written in between (the server answers "publication ... does not exist", SQLSTATE
//!   42704, while it exists);
//! - publications made by hand that do not cover the outbox table's inserts and
//!   updates (the table left out, inserts only, a row filter, a column list): refused
//!   by `setup` and by the relay at start, the slot's position unchanged; `FOR ALL
//!   TABLES` and `FOR TABLES IN SCHEMA` taken.
//!
//! The tests take the machine-wide fault lock (a memory alarm blocks every publisher
//! on the broker; a stopped PostgreSQL every client; `max_slot_wal_keep_size` and
//! `pg_wal` are the server's) and undo their fault on drop, also when they panic; the
//! publication tests, which touch only their own objects, take it shared. Their own
//! test binary: the relay tests in `wal_relay.rs` would meet the faults too.
#![cfg(feature = "wal")]

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::database_url;
use common::rabbit::publisher_to;
use common::wal::{HoldBatch, WalOutbox};
use lapin::BasicProperties;
use lapin::options::{
    BasicPublishOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use outboxkit_core::{
    EventPublisher, MessageStatus, NewMessage, OutboxMessage, OutboxProducer, OutboxStore as _,
    PublishError, PublishOutcome,
};
use outboxkit_postgres::wal::{WalError, WalRelayConfig};
use outboxkit_rabbit::RabbitPublisher;
use outboxkit_testkit::faults::{self, PgStopped, RabbitMemoryAlarm};
use outboxkit_testkit::rabbit::{
    DropExchange, amqp_url, eventually, reject_when_full, relay_fixture,
};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Publishes through RabbitMQ. In the first batch holding `trigger`, the messages up
/// to `trigger` are published and confirmed (or refused) first, then a real memory
/// alarm is raised and the rest of the batch is published into it: an outage that
/// begins inside one batch, as a broker alarmed, frozen or restarted mid-publish does.
///
/// With `others`, the rest of the batch waits (at most 30 s) until as many other
/// batches began to be published after the alarm (batches in flight meeting the same
/// outage); `begun` and `ended` count the calls of other batches begun in the alarm
/// while the trigger's call was running.
struct AlarmAfter {
    inner: Arc<RabbitPublisher>,
    trigger: Uuid,
    fired: AtomicBool,
    alarm: Arc<Mutex<Option<RabbitMemoryAlarm>>>,
    others: usize,
    begun: AtomicUsize,
    ended: AtomicUsize,
    /// Whether the trigger's call has ended.
    done: AtomicBool,
}

impl AlarmAfter {
    fn new(
        inner: RabbitPublisher,
        trigger: Uuid,
        alarm: &Arc<Mutex<Option<RabbitMemoryAlarm>>>,
        others: usize,
    ) -> Self {
        Self {
            inner: Arc::new(inner),
            trigger,
            fired: AtomicBool::new(false),
            alarm: Arc::clone(alarm),
            others,
            begun: AtomicUsize::new(0),
            ended: AtomicUsize::new(0),
            done: AtomicBool::new(false),
        }
    }
}

#[async_trait::async_trait]
impl EventPublisher for AlarmAfter {
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<PublishOutcome> {
        let at = messages.iter().position(|m| m.id == self.trigger);
        let Some(at) = at.filter(|_| !self.fired.swap(true, Ordering::SeqCst)) else {
            // Begun in the alarm while the trigger's batch is in flight.
            let alarmed =
                self.alarm.lock().expect("lock").is_some() && !self.done.load(Ordering::SeqCst);
            if alarmed {
                self.begun.fetch_add(1, Ordering::SeqCst);
            }
            let outcomes = self.inner.publish_batch(messages).await;
            if alarmed {
                self.ended.fetch_add(1, Ordering::SeqCst);
            }
            return outcomes;
        };
        let mut outcomes = self.inner.publish_batch(&messages[..=at]).await;
        let alarm = tokio::task::spawn_blocking(RabbitMemoryAlarm::raise)
            .await
            .expect("raise the memory alarm");
        *self.alarm.lock().expect("lock") = Some(alarm);
        if self.others > 0 {
            eventually(Duration::from_secs(30), || async {
                self.begun.load(Ordering::SeqCst) >= self.others
            })
            .await;
        }
        outcomes.extend(self.inner.publish_batch(&messages[at + 1..]).await);
        self.done.store(true, Ordering::SeqCst);
        outcomes
    }

    fn publish_timeout(&self) -> Option<Duration> {
        // Raising the alarm (`rabbitmqctl`, a few seconds) happens inside one call.
        self.inner
            .publish_timeout()
            .map(|t| t + Duration::from_secs(30))
    }

    async fn check_ready(&self) -> Result<(), PublishError> {
        self.inner.check_ready().await
    }
}

fn message(key: &str, event_type: &str) -> NewMessage {
    NewMessage::builder("t", key, event_type)
        .payload(&serde_json::json!({ "key": key }))
        .build()
        .expect("message")
}

/// A WAL relay (batches of 10) publishing through `publisher`, past a new session's
/// careful first rounds (as many messages as a batch): 20 messages sent.
async fn start_warmed<P: EventPublisher + 'static>(
    w: &WalOutbox,
    publisher: Arc<P>,
    token: &CancellationToken,
) -> tokio::task::JoinHandle<outboxkit_postgres::wal::WalRelayStats> {
    let config = WalRelayConfig::new(database_url())
        .with_standby_interval(Duration::from_millis(100))
        .with_batch_size(10);
    let relay = w.spawn(publisher, config, token);
    let warm_up: Vec<NewMessage> = (0..20).map(|i| message(&format!("w{i}"), "main")).collect();
    w.enqueue(&warm_up).await;
    let warmed = eventually(Duration::from_secs(30), || async {
        w.outbox.stats().await.expect("stats").sent == 20
    })
    .await;
    assert!(warmed, "the warm-up is sent");
    relay
}

async fn status(w: &WalOutbox, id: Uuid) -> MessageStatus {
    w.outbox.get(id).await.expect("get").expect("row").status
}

/// Key `k1` has a message for the full `side` queue, then, after the alarm, one for
/// `main`; `k3` one for `side` after the alarm. After it: every message published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_inside_a_batch_after_a_refusal_strands_no_key() {
    let _lock = faults::lock().await;
    let w = WalOutbox::new().await;
    // The exchange and a queue taking everything (`#`), and `side`'s full queue.
    let fx = relay_fixture(FieldTable::default()).await;
    let _drop_exchange = DropExchange::new(&amqp_url(), &fx.exchange);
    let full = format!("{}.full", fx.queue);
    let mut args = reject_when_full(1);
    args.insert("x-expires".into(), AMQPValue::LongInt(60_000));
    fx.channel
        .queue_declare(full.as_str().into(), QueueDeclareOptions::default(), args)
        .await
        .expect("declare the full queue");
    fx.channel
        .queue_bind(
            full.as_str().into(),
            fx.exchange.as_str().into(),
            "side".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind the full queue");
    fx.channel
        .basic_publish(
            fx.exchange.as_str().into(),
            "side".into(),
            BasicPublishOptions::default(),
            b"filler",
            BasicProperties::default(),
        )
        .await
        .expect("publish the filler")
        .await
        .expect("filler confirmed");

    let publisher = publisher_to(&fx.exchange).await;
    // The outage meets `k2` first: the messages after it are not looked at in that
    // round and go again in the next, where `k1`'s waits behind its parked message and
    // `k3`'s behind its destination's open circuit.
    let batch = [
        message("k1", "side"),
        message("k2", "main"),
        message("k1", "main"),
        message("k3", "side"),
        message("k4", "main"),
    ];
    let alarm = Arc::new(Mutex::new(None));
    let publisher = Arc::new(AlarmAfter::new(publisher, batch[0].id, &alarm, 0));
    let token = CancellationToken::new();
    let relay = start_warmed(&w, publisher, &token).await;

    // One transaction: one batch of the stream.
    w.enqueue(&batch).await;
    let refused_then_alarmed = eventually(Duration::from_secs(60), || async {
        alarm.lock().expect("lock").is_some()
            && status(&w, batch[0].id).await == MessageStatus::Processing
    })
    .await;
    assert!(
        refused_then_alarmed,
        "k1's side message refused and parked, then the alarm raised"
    );
    let cleared = alarm.lock().expect("lock").take();
    tokio::task::spawn_blocking(move || drop(cleared))
        .await
        .expect("clear the alarm");
    // Room for both side messages: the full queue goes (it held one message at most).
    fx.channel
        .queue_delete(full.as_str().into(), QueueDeleteOptions::default())
        .await
        .expect("delete the full queue");

    let all_sent = eventually(Duration::from_secs(30), || async {
        w.outbox.stats().await.expect("stats").sent == 25
    })
    .await;
    let mut statuses = Vec::new();
    for m in &batch {
        statuses.push((
            m.aggregate_id.clone(),
            m.event_type.clone(),
            status(&w, m.id).await,
        ));
    }
    token.cancel();
    let stats = relay.await.expect("join");
    assert!(
        all_sent,
        "every message sent once the alarm is cleared and the full queue is gone: {statuses:?}, {stats:?}"
    );
    assert_eq!(stats.dead, 0, "{stats:?}");
}

/// Batches in flight (the pipeline) meet an outage: a memory alarm raised while the
/// first of them is being published, the next ones (three transactions written after
/// the alarm) published into it before the first one's rest (the rest waits for one of
/// them to begin). The
/// first's messages before the alarm are recorded; its rest and the three later
/// batches go again, in order, once the alarm is cleared: every row is sent, none is
/// dead, and the broker received every message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_meets_the_batches_in_flight_and_loses_none() {
    let _lock = faults::lock().await;
    let w = WalOutbox::new().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let _drop_exchange = DropExchange::new(&amqp_url(), &fx.exchange);
    let received = fx.counter().await;
    let first = [
        message("a", "main"),
        message("b", "main"),
        message("c", "main"),
    ];
    let later = [
        message("d", "main"),
        message("e", "main"),
        message("f", "main"),
    ];
    let alarm = Arc::new(Mutex::new(None));
    let publisher = Arc::new(AlarmAfter::new(
        publisher_to(&fx.exchange).await,
        first[0].id,
        &alarm,
        1,
    ));
    let token = CancellationToken::new();
    let relay = start_warmed(&w, Arc::clone(&publisher), &token).await;

    w.enqueue(&first).await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            alarm.lock().expect("lock").is_some()
        })
        .await,
        "the alarm is raised inside the first batch"
    );
    for m in &later {
        w.enqueue(std::slice::from_ref(m)).await;
    }
    // Until the first batch's call and the later ones have come back (from the
    // alarm: an outage).
    let in_flight = eventually(Duration::from_secs(60), || async {
        let begun = publisher.begun.load(Ordering::SeqCst);
        publisher.done.load(Ordering::SeqCst)
            && begun >= 1
            && publisher.ended.load(Ordering::SeqCst) >= begun
    })
    .await;
    let begun = publisher.begun.load(Ordering::SeqCst);
    let cleared = alarm.lock().expect("lock").take();
    tokio::task::spawn_blocking(move || drop(cleared))
        .await
        .expect("clear the alarm");
    assert!(
        in_flight,
        "a later batch was published while the first was in flight ({begun} calls began in the alarm)"
    );

    let all_sent = eventually(Duration::from_secs(60), || async {
        w.outbox.stats().await.expect("stats").sent == 26
    })
    .await;
    let all_received = eventually(Duration::from_secs(30), || async {
        let received = received.lock().expect("lock");
        first
            .iter()
            .chain(&later)
            .all(|m| received.contains_key(&m.id.to_string()))
    })
    .await;
    token.cancel();
    let stats = relay.await.expect("join");
    assert!(
        all_sent,
        "every row sent once the alarm is cleared: {stats:?}"
    );
    assert!(all_received, "the broker received every message");
    assert_eq!(stats.dead, 0, "{stats:?}");
}

/// Whether a new connection to PostgreSQL is refused (the server is shutting down or
/// down).
async fn refuses_connections() -> bool {
    use sqlx::Connection as _;
    match sqlx::PgConnection::connect(&database_url()).await {
        Ok(conn) => {
            let _ = conn.close().await;
            false
        }
        Err(_) => true,
    }
}

/// A batch held in publishing while PostgreSQL is stopped: the stop completes within
/// 8 s (the relay ends its session 3 s after recording first failed), and after the
/// restart every message is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_shutting_down_waits_no_longer_than_the_record_hold() {
    let _lock = faults::lock().await;
    let w = WalOutbox::new().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let _drop_exchange = DropExchange::new(&amqp_url(), &fx.exchange);
    let publisher = publisher_to(&fx.exchange).await;
    let batch: Vec<NewMessage> = (0..5).map(|i| message(&format!("b{i}"), "main")).collect();
    let publisher = Arc::new(HoldBatch::new(publisher, batch[0].id));
    let token = CancellationToken::new();
    let relay = start_warmed(&w, Arc::clone(&publisher), &token).await;

    w.enqueue(&batch).await;
    tokio::time::timeout(Duration::from_secs(30), publisher.held.notified())
        .await
        .expect("the batch is being published");
    let stop = tokio::task::spawn_blocking(|| {
        let began = std::time::Instant::now();
        let stopped = PgStopped::try_stop().expect("stop PostgreSQL");
        (stopped, began.elapsed())
    });
    let shutting_down = eventually(Duration::from_secs(30), refuses_connections).await;
    // The publish ends now: its outcomes cannot be recorded.
    publisher.release.notify_one();
    let (stopped, took) = stop.await.expect("the stop");
    assert!(
        shutting_down,
        "PostgreSQL refused connections while stopping"
    );
    tokio::task::spawn_blocking(move || drop(stopped))
        .await
        .expect("start PostgreSQL again");
    assert!(
        took < Duration::from_secs(8),
        "the fast shutdown waited {took:?} for the relay's replication session"
    );

    let all_sent = eventually(Duration::from_secs(60), || async {
        w.outbox.stats().await.is_ok_and(|s| s.sent == 25)
    })
    .await;
    token.cancel();
    let stats = relay.await.expect("join");
    assert!(all_sent, "every message sent after the restart: {stats:?}");
    assert_eq!(stats.dead, 0, "{stats:?}");
}

/// A relay warmed up (see `start_warmed`) and stopped, then 5 messages committed while
/// no relay reads the slot: the slot's position is behind them.
async fn stop_behind(w: &WalOutbox, publisher: &Arc<RabbitPublisher>) -> Vec<Uuid> {
    let token = CancellationToken::new();
    let relay = start_warmed(w, Arc::clone(publisher), &token).await;
    token.cancel();
    relay.await.expect("join");
    let pending: Vec<NewMessage> = (0..5).map(|i| message(&format!("p{i}"), "main")).collect();
    w.enqueue(&pending).await;
    pending.iter().map(|m| m.id).collect()
}

/// A relay's settings for the slot's faults: batches of 10, the slot checked every
/// 200 ms.
fn checking_config() -> WalRelayConfig {
    WalRelayConfig::new(database_url())
        .with_standby_interval(Duration::from_millis(100))
        .with_gauge_interval(Duration::from_millis(200))
        .with_batch_size(10)
}

/// The error `run` ends with (within 30 s: a relay retrying for ever fails the test).
async fn stops_with(
    run: impl Future<Output = Result<outboxkit_postgres::wal::WalRelayStats, WalError>>,
) -> WalError {
    match tokio::time::timeout(Duration::from_secs(30), run).await {
        Ok(Err(e)) => e,
        Ok(Ok(stats)) => panic!("the relay stopped without an error: {stats:?}"),
        Err(_) => panic!("the relay still runs after 30 s: it retries for ever"),
    }
}

/// A relay warmed up and stopped, 5 messages committed, then `fault` done to the slot:
/// the error a relay started again stops with, after checking that it stopped for
/// good and lost nothing (see [`stopped_for_good`]).
async fn restarted_after_a_slot_fault(fault: impl AsyncFnOnce(&WalOutbox)) -> WalError {
    let w = WalOutbox::new().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let _drop_exchange = DropExchange::new(&amqp_url(), &fx.exchange);
    let publisher = Arc::new(publisher_to(&fx.exchange).await);
    let pending = stop_behind(&w, &publisher).await;
    fault(&w).await;
    let relay = w.relay(publisher, checking_config());
    let e = stops_with(relay.run(CancellationToken::new())).await;
    stopped_for_good(&w, &e, &pending).await;
    e
}

/// What a relay that stopped for the slot's sake must do: stop for good (not a
/// retryable error) and tell the operator to start over, losing nothing: the rows
/// still pending are `New` in the table, for the polling relay.
async fn stopped_for_good(w: &WalOutbox, e: &WalError, pending: &[Uuid]) {
    assert!(!e.is_retryable(), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("outbox wal drop") && text.contains("outbox wal setup"),
        "the error says how to start over: {text}"
    );
    for id in pending {
        assert_eq!(
            status(w, *id).await,
            MessageStatus::New,
            "{id} stays pending"
        );
    }
}

/// The slot invalidated by PostgreSQL while no relay reads it (it retained more WAL
/// than `max_slot_wal_keep_size`, and a checkpoint came: `wal_status = 'lost'`): the
/// relay stops at once, telling the operator to start over. Before: the server's
/// refusal to read it (SQLSTATE 55000) was retried for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidated_slot_stops_the_relay_with_what_to_do() {
    let _lock = faults::lock().await;
    let e = restarted_after_a_slot_fault(async |w| {
        outboxkit_testkit::slot::invalidate(w.outbox.pool(), &database_url(), w.wal.slot()).await;
    })
    .await;
    assert!(
        matches!(&e, WalError::SlotInvalidated { reason, .. } if reason.starts_with("wal_removed")),
        "{e}"
    );
}

/// The WAL segment the slot restarts from deleted from `pg_wal` while no relay reads
/// it (the slot still says `reserved`): the relay stops, telling the operator to start
/// over. Before: the server's "requested WAL segment ... has already been removed"
/// (SQLSTATE 58P01) was retried for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_wal_stops_the_relay_with_what_to_do() {
    let _lock = faults::lock().await;
    let e = restarted_after_a_slot_fault(async |w| {
        outboxkit_testkit::slot::remove_wal(w.outbox.pool(), w.wal.slot()).await;
    })
    .await;
    assert!(matches!(e, WalError::WalRemoved { .. }), "{e}");
}

/// The publication dropped and created again while the relay runs, a producer's
/// transaction writing a row in between (committed after: the relay meets the gap only
/// once the publication is back). The slot cannot be decoded past that row (pgoutput
/// reads the publication as the catalog was at each change): the relay stops, telling
/// the operator to start over, and the row stays pending. Before: "publication ... does
/// not exist" (SQLSTATE 42704) was retried for ever, the publication being there at
/// every check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_created_again_under_the_relay_stops_it() {
    let _lock = faults::lock_shared().await;
    let w = WalOutbox::new().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let _drop_exchange = DropExchange::new(&amqp_url(), &fx.exchange);
    let publisher = Arc::new(publisher_to(&fx.exchange).await);
    let relay = w.relay(Arc::clone(&publisher), checking_config());
    let run = tokio::spawn(async move { relay.run(CancellationToken::new()).await });
    let warm = message("w", "main");
    w.enqueue(std::slice::from_ref(&warm)).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            status(&w, warm.id).await == MessageStatus::Sent
        })
        .await,
        "the relay reads the slot"
    );

    let pool = w.outbox.pool();
    let mut producer = pool.begin().await.expect("begin");
    let publication = w.wal.publication();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP PUBLICATION {publication}"
    )))
    .execute(pool)
    .await
    .expect("drop the publication");
    let gap = message("gap", "main");
    w.outbox
        .enqueue_batch(&mut producer, std::slice::from_ref(&gap))
        .await
        .expect("enqueue");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE PUBLICATION {publication} FOR TABLE {}.outbox_messages WITH (publish = 'insert, update')",
        w.outbox.schema()
    )))
    .execute(pool)
    .await
    .expect("create the publication again");
    producer.commit().await.expect("commit");

    let e = stops_with(async { run.await.expect("join") }).await;
    // (Missing, if another test's change met the gap before the publication was back.)
    assert!(
        matches!(
            e,
            WalError::PublicationRecreated { .. } | WalError::PublicationMissing { .. }
        ),
        "{e}"
    );
    stopped_for_good(&w, &e, &[gap.id]).await;
}

/// Publications made by hand under the relay's name, and a slot: those that do not
/// cover every insert and update of the outbox table (the table left out, inserts only,
/// a row filter, a column list) are refused by `setup` (nothing created) and by the
/// relay at start (the slot's position unchanged); `FOR ALL TABLES` and `FOR TABLES IN
/// SCHEMA` with inserts and updates are taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_must_cover_the_tables_inserts_and_updates() {
    let _lock = faults::lock_shared().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let _drop_exchange = DropExchange::new(&amqp_url(), &fx.exchange);
    let publisher = Arc::new(publisher_to(&fx.exchange).await);
    let cases = [
        ("FOR TABLE {s}.other", Some("the table is not in it")),
        (
            "FOR TABLE {s}.outbox_messages WITH (publish = 'insert, delete')",
            Some("publish = 'insert, delete'"),
        ),
        (
            "FOR TABLE {s}.outbox_messages WHERE (status = 0)",
            Some("row filter"),
        ),
        (
            "FOR TABLE {s}.outbox_messages (id, aggregate_type, aggregate_id, event_type, payload)",
            Some("its column list leaves out"),
        ),
        ("FOR TABLES IN SCHEMA {s}", None),
        ("FOR ALL TABLES", None),
    ];
    for (definition, refused) in cases {
        let outbox = common::fresh_outbox_kept().await;
        let wal = outboxkit_postgres::wal::WalConfig::new(outbox.schema());
        let w = WalOutbox { outbox, wal };
        let pool = w.outbox.pool();
        let schema = w.outbox.schema();
        let sql = |text: &str| text.replace("{s}", schema);
        for statement in [
            sql("CREATE TABLE {s}.other (n int)"),
            format!(
                "CREATE PUBLICATION {} {}",
                w.wal.publication(),
                sql(definition)
            ),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(pool)
                .await
                .expect("create");
        }
        let setup = outboxkit_postgres::wal::setup(&w.outbox, &w.wal).await;
        let Some(gap) = refused else {
            setup.unwrap_or_else(|e| panic!("{definition}: {e}"));
            outboxkit_postgres::wal::check(&w.outbox, &w.wal)
                .await
                .unwrap_or_else(|e| panic!("{definition}: {e}"));
            continue;
        };
        match setup {
            Err(e @ WalError::PublicationIncomplete { .. }) => {
                assert!(e.to_string().contains(gap), "{definition}: {e}");
            }
            other => panic!("{definition}: setup must refuse: {other:?}"),
        }
        let status = outboxkit_postgres::wal::status(&w.outbox, &w.wal)
            .await
            .expect("status");
        assert!(!status.slot_exists, "{definition}: nothing created");
        assert!(
            status
                .publication_gap
                .as_deref()
                .is_some_and(|g| g.contains(gap)),
            "{definition}: {status:?}"
        );

        // A slot made by hand, messages after it: the relay does not start.
        let at: String = sqlx::query_scalar(
            "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
        )
        .bind(w.wal.slot())
        .fetch_one(pool)
        .await
        .expect("slot");
        w.enqueue(&[message("r", "main")]).await;
        let relay = w.relay(Arc::clone(&publisher), checking_config());
        let e = stops_with(relay.run(CancellationToken::new())).await;
        assert!(
            matches!(e, WalError::PublicationIncomplete { .. }),
            "{definition}: {e}"
        );
        let confirmed: String = sqlx::query_scalar(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(w.wal.slot())
        .fetch_one(pool)
        .await
        .expect("confirmed");
        assert_eq!(confirmed, at, "{definition}: the slot did not move");
    }
}
