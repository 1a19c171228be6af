//! `outbox relay` as a process under faults, against the real PostgreSQL, RabbitMQ and
//! NATS: poison rows among good ones, a full queue, a broker memory alarm, a frozen
//! NATS server, a database that rejects completions, and a shutdown behind a frozen
//! broker. Each test checks the table and, independently, what the broker received.
//!
//! Several tests change a shared server (a memory alarm blocks every publishing
//! connection, `max_message_size` applies to every channel, a frozen NATS answers no
//! one), so every test here holds the machine-wide fault lock of
//! `outboxkit_testkit::faults` and they run one at a time; the guards undo each fault even
//! when the test fails.
//!
//! `OUTBOX_RELAY_BIN` runs them against another build of the binary (an older release,
//! to watch a fault reproduce); by default they run this build's `outbox`.

mod common;

use std::collections::{HashMap, HashSet};

use std::time::{Duration, Instant};

use common::{RelayProcess, amqp_url, enqueue, exec, fresh_outbox, scalar, wait_until};
use futures::StreamExt as _;
use lapin::types::FieldTable;
use outboxkit_core::NewMessage;
use outboxkit_nats::async_nats::{self, jetstream};
use outboxkit_nats::{NatsConfig, StreamSetup};
use outboxkit_postgres::PgOutbox;
use outboxkit_rabbit::lapin;
use outboxkit_testkit::faults::{self, NatsFrozen, RabbitMaxMessageSize, RabbitMemoryAlarm};
use outboxkit_testkit::rabbit::{Fixture, reject_when_full, relay_fixture};
use uuid::Uuid;

const NATS_URL: &str = "nats://127.0.0.1:4222";

/// Rows by status code.
async fn count(db: &PgOutbox, status: i16) -> i64 {
    scalar(
        db,
        &format!("SELECT count(*) FROM {{s}}.outbox_messages WHERE status = {status}"),
    )
    .await
}

async fn pending(db: &PgOutbox) -> i64 {
    scalar(
        db,
        "SELECT count(*) FROM {s}.outbox_messages WHERE status IN (0, 9)",
    )
    .await
}

/// (status, attempts, last_error) of row `id`.
async fn row(db: &PgOutbox, id: Uuid) -> (i16, i32, Option<String>) {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT status, attempts, last_error FROM {}.outbox_messages WHERE id = $1",
        db.schema()
    )))
    .bind(id)
    .fetch_one(db.pool())
    .await
    .expect("row")
}

/// The largest `attempts` of any row.
async fn max_attempts(db: &PgOutbox) -> i64 {
    scalar(
        db,
        "SELECT coalesce(max(attempts), 0)::int8 FROM {s}.outbox_messages",
    )
    .await
}

fn orders(n: usize, tag: &str) -> Vec<NewMessage> {
    (0..n)
        .map(|i| {
            NewMessage::builder("order", format!("{tag}-{i}"), "OrderPlaced")
                .payload(&serde_json::json!({ "n": i }))
                .build()
                .expect("valid")
        })
        .collect()
}

/// Turns row `id` into poison with `set` (an SQL assignment list), as a trigger, a
/// migration or another language's producer might.
async fn poison(db: &PgOutbox, id: Uuid, set: &str) {
    let sql = format!("UPDATE {{s}}.outbox_messages SET {set} WHERE id = '{id}'");
    assert_eq!(exec(db, &sql).await, 1);
}

/// A JetStream stream capturing `<prefix>.>`, file storage, 2-minute duplicate window.
struct Stream {
    name: String,
    prefix: String,
    js: jetstream::Context,
}

impl Stream {
    async fn new() -> Self {
        let tag = Uuid::new_v4().simple().to_string();
        let name = format!("TEST_{tag}");
        let prefix = format!("test.{tag}");
        let config = NatsConfig::new(NATS_URL).with_subject_prefix(&prefix);
        StreamSetup::for_config(&name, &config)
            .with_duplicate_window(Duration::from_secs(120))
            .apply(&config)
            .await
            .expect("create the stream (is NATS running with -js?)");
        let client = async_nats::connect(NATS_URL)
            .await
            .expect("connect to NATS");
        Self {
            name,
            prefix,
            js: jetstream::new(client),
        }
    }

    /// How many times each message id (`Nats-Msg-Id`) is stored.
    async fn ids(&self) -> HashMap<Uuid, usize> {
        let stream = self.js.get_stream(&self.name).await.expect("stream");
        let mut info = stream.clone();
        let stored = info.info().await.expect("info").state.messages;
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::Config {
                ack_policy: jetstream::consumer::AckPolicy::None,
                ..Default::default()
            })
            .await
            .expect("consumer");
        let mut messages = consumer.messages().await.expect("messages");
        let mut ids = HashMap::new();
        for _ in 0..stored {
            let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
                .await
                .expect("every stored message arrives")
                .expect("open")
                .expect("message");
            let id = message
                .headers
                .as_ref()
                .and_then(|h| h.get("Nats-Msg-Id"))
                .and_then(|v| v.as_str().parse::<Uuid>().ok())
                .expect("Nats-Msg-Id");
            *ids.entry(id).or_insert(0) += 1;
        }
        ids
    }

    async fn delete(self) {
        let _ = self.js.delete_stream(&self.name).await;
    }
}

/// Waits until nothing new has arrived at `counts` for two seconds; returns them.
async fn quiet(
    counts: &std::sync::Arc<std::sync::Mutex<HashMap<String, usize>>>,
) -> HashMap<Uuid, usize> {
    let total = || -> usize { counts.lock().expect("lock").values().sum() };
    let mut last = total();
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let now = total();
        if now == last {
            break;
        }
        last = now;
    }
    counts
        .lock()
        .expect("lock")
        .iter()
        .filter_map(|(id, n)| Some((id.parse().ok()?, *n)))
        .collect()
}

fn rabbit_args(fx: &Fixture) -> Vec<String> {
    [
        "--transport",
        "rabbit",
        "--broker-url",
        &amqp_url(),
        "--exchange",
        &fx.exchange,
    ]
    .map(str::to_owned)
    .to_vec()
}

fn nats_args(stream: &Stream) -> Vec<String> {
    [
        "--transport",
        "nats",
        "--broker-url",
        NATS_URL,
        "--subject-prefix",
        &stream.prefix,
    ]
    .map(str::to_owned)
    .to_vec()
}

fn with<'a>(base: &'a [String], more: &[&'a str]) -> Vec<&'a str> {
    base.iter()
        .map(String::as_str)
        .chain(more.iter().copied())
        .collect()
}

/// A row made poison: its index among the test's messages, the SQL assignments that
/// spoil it, and what its `last_error` must say.
type PoisonCase = (usize, String, &'static str);

/// Spoils the `cases` rows of `msgs`, runs the relay with `args` until no row is
/// pending, and checks that it still runs, that each poison row is dead alone (charged
/// at most once) with the expected reason, and that every other row is sent after one
/// attempt. Returns the running relay.
async fn poison_rows_die_alone(
    db: &PgOutbox,
    args: &[&str],
    msgs: &[NewMessage],
    cases: &[PoisonCase],
) -> RelayProcess {
    for (i, set, _) in cases {
        poison(db, msgs[*i].id, set).await;
    }
    let mut relay = RelayProcess::start(db, args);
    wait_until(
        &relay,
        Duration::from_secs(60),
        "no row is pending",
        || async { pending(db).await == 0 },
    )
    .await;
    assert!(relay.running(), "the relay still runs:\n{}", relay.log());
    for (i, _, reason) in cases {
        let (status, attempts, error) = row(db, msgs[*i].id).await;
        assert_eq!(status, 3, "poison row {i} is dead");
        assert!(attempts <= 1, "row {i}: {attempts} attempts");
        let error = error.unwrap_or_default();
        assert!(
            error.contains(reason),
            "row {i}: {error:?} should say {reason:?}"
        );
    }
    let good = i64::try_from(msgs.len() - cases.len()).expect("count");
    assert_eq!(count(db, 1).await, good, "every good row is sent");
    assert_eq!(max_attempts(db).await, 1, "no good row was charged twice");
    relay
}

/// Keeps an injected fault for `how_long` while checking that the relay kills and
/// charges nothing.
async fn nothing_dies_or_is_charged(db: &PgOutbox, relay: &RelayProcess, how_long: Duration) {
    let until = Instant::now() + how_long;
    while Instant::now() < until {
        assert_eq!(count(db, 3).await, 0, "a message died:\n{}", relay.log());
        assert!(
            max_attempts(db).await <= 1,
            "an attempt was charged:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Starts the relay over `first` (already enqueued) and waits until they are sent.
async fn relay_warmed_up(db: &PgOutbox, args: &[&str], first: usize) -> RelayProcess {
    let relay = RelayProcess::start(db, args);
    let want = i64::try_from(first).expect("count");
    wait_until(
        &relay,
        Duration::from_secs(30),
        "the first rows are sent",
        || async { count(db, 1).await == want },
    )
    .await;
    relay
}

/// An outage injected for real: the relay (at most 2 attempts, a 2 s confirm timeout)
/// sends `first` messages, then `fault()` is injected (its guard undoes it when
/// dropped), `during` more messages are enqueued, and for 20 s nothing may die or be
/// charged; once the fault is undone every row must be sent after one attempt. Returns
/// the relay, still running, and every message.
async fn an_outage_charges_nothing<G>(
    db: &PgOutbox,
    args: &[&str],
    first: usize,
    during: usize,
    fault: impl FnOnce() -> G,
) -> (RelayProcess, Vec<NewMessage>) {
    let mut all = orders(first, "before-outage");
    enqueue(db, &all).await;
    let flags = [
        "--max-attempts",
        "2",
        "--confirm-timeout",
        "2s",
        "--lease",
        "20s",
    ];
    let args: Vec<&str> = args.iter().chain(&flags).copied().collect();
    let mut relay = relay_warmed_up(db, &args, first).await;
    let guard = fault();
    let more = orders(during, "during-outage");
    enqueue(db, &more).await;
    all.extend(more);
    nothing_dies_or_is_charged(db, &relay, Duration::from_secs(20)).await;
    drop(guard);
    let total = i64::try_from(all.len()).expect("count");
    wait_until(
        &relay,
        Duration::from_secs(120),
        "every row is sent",
        || async { count(db, 1).await == total },
    )
    .await;
    assert!(relay.running(), "{}", relay.log());
    assert_eq!(count(db, 3).await, 0);
    assert_eq!(max_attempts(db).await, 1, "no attempt was charged");
    (relay, all)
}

/// SIGTERM, then a clean exit within 30 s.
async fn stops_cleanly(mut relay: RelayProcess) {
    relay.terminate();
    let status = relay.exited_within(Duration::from_secs(30)).await;
    assert!(
        status.is_some_and(|s| s.success()),
        "clean exit: {status:?}\n{}",
        relay.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_poison_rows_die_alone_and_the_relay_keeps_running() {
    let _lock = faults::lock().await;
    let db = fresh_outbox().await;
    let stream = Stream::new().await;
    let msgs = orders(15, "nats-poison");
    enqueue(&db, &msgs).await;
    let big = "x".repeat(1_200_000);
    let cases: [PoisonCase; 5] = [
        (
            2,
            r#"headers = '{"größe": "x"}'"#.into(),
            "not a NATS header name",
        ),
        (4, r#"headers = '{"retries": 3}'"#.into(), "undecodable row"),
        (6, r#"headers = '{"note": "a\nb"}'"#.into(), "line break"),
        (
            8,
            r#"headers = '{"Nats-Expected-Stream": "other"}'"#.into(),
            "reserved for JetStream",
        ),
        (
            10,
            format!("payload = to_json('{big}'::text)"),
            "exceeds the broker limit",
        ),
    ];
    let args = nats_args(&stream);
    let relay = poison_rows_die_alone(&db, &with(&args, &[]), &msgs, &cases).await;
    let poisoned: HashSet<usize> = cases.iter().map(|c| c.0).collect();
    let stored = stream.ids().await;
    for (i, m) in msgs.iter().enumerate() {
        let want = usize::from(!poisoned.contains(&i));
        assert_eq!(
            stored.get(&m.id).copied().unwrap_or(0),
            want,
            "message {i} in the stream"
        );
    }
    stops_cleanly(relay).await;
    stream.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbit_poison_rows_die_alone_and_no_good_row_is_charged() {
    let _lock = faults::lock().await;
    // The broker takes at most 64 KiB; the relay's own limit is the default 16 MiB, so
    // the broker closes the channel (406) for the big message and the rest of its batch.
    let _limit = RabbitMaxMessageSize::set(64 * 1024);
    let db = fresh_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let counts = fx.counter().await;
    let msgs = orders(30, "rabbit-poison");
    enqueue(&db, &msgs).await;
    let big = "x".repeat(100 * 1024);
    let long_name = "h".repeat(300);
    let cases: [PoisonCase; 3] = [
        (3, r#"headers = '{"retries": 3}'"#.into(), "undecodable row"),
        (
            7,
            format!(r#"headers = '{{"{long_name}": "x"}}'"#),
            // outboxkit_core::wire::check_limits, before the transport encodes the row.
            "header name is 300 bytes long, the maximum is 255",
        ),
        (
            20,
            format!("payload = to_json('{big}'::text)"),
            "406 PRECONDITION_FAILED for this message alone",
        ),
    ];
    // No good row charged twice: the channel closed by one message charged no other.
    let args = rabbit_args(&fx);
    let relay = poison_rows_die_alone(&db, &with(&args, &[]), &msgs, &cases).await;
    let arrived = quiet(&counts).await;
    let poisoned: HashSet<usize> = cases.iter().map(|c| c.0).collect();
    for (i, m) in msgs.iter().enumerate() {
        let n = arrived.get(&m.id).copied().unwrap_or(0);
        if poisoned.contains(&i) {
            assert_eq!(n, 0, "poison message {i} reached the queue");
        } else {
            assert!(n >= 1, "good message {i} never reached the queue");
        }
    }
    stops_cleanly(relay).await;
    fx.delete_exchange().await;
}

/// A queue at its `x-max-length` with `reject-publish` nacks every publish for 30 s:
/// an outage, so nothing is charged and nothing dies; once the queue is consumed every
/// message arrives once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_dead_letters_nothing() {
    let _lock = faults::lock().await;
    let db = fresh_outbox().await;
    let fx = relay_fixture(reject_when_full(10)).await;
    let msgs = orders(100, "full");
    enqueue(&db, &msgs).await;
    let args = rabbit_args(&fx);
    // Ten fill the queue; the rest meet a full queue.
    let mut relay = relay_warmed_up(
        &db,
        &with(&args, &["--max-attempts", "2", "--batch-size", "20"]),
        10,
    )
    .await;
    nothing_dies_or_is_charged(&db, &relay, Duration::from_secs(30)).await;
    assert!(relay.running(), "{}", relay.log());
    let counts = fx.counter().await;
    wait_until(
        &relay,
        Duration::from_secs(90),
        "every row is sent",
        || async { count(&db, 1).await == 100 },
    )
    .await;
    let arrived = quiet(&counts).await;
    for m in &msgs {
        assert_eq!(
            arrived.get(&m.id),
            Some(&1),
            "message {} arrives once",
            m.id
        );
    }
    assert_eq!(count(&db, 3).await, 0);
    assert_eq!(max_attempts(&db).await, 1, "no attempt was charged");
    fx.delete_exchange().await;
}

/// A RabbitMQ memory alarm blocks the relay's connection for 20 s: an outage, nothing
/// is charged and nothing dies; after the alarm every message arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_alarm_dead_letters_nothing() {
    let _lock = faults::lock().await;
    let db = fresh_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let counts = fx.counter().await;
    let args = rabbit_args(&fx);
    let (relay, all) =
        an_outage_charges_nothing(&db, &with(&args, &[]), 20, 200, RabbitMemoryAlarm::raise).await;
    let arrived = quiet(&counts).await;
    for m in &all {
        assert!(
            arrived.get(&m.id).is_some_and(|n| *n >= 1),
            "message {} arrived",
            m.id
        );
    }
    stops_cleanly(relay).await;
    fx.delete_exchange().await;
}

/// The NATS server frozen (SIGSTOP) for 20 s while 2,000 messages wait: no PubAck
/// comes, which is an outage; nothing is charged or dies, and afterwards the stream
/// holds every message exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_nats_server_dead_letters_nothing() {
    let _lock = faults::lock().await;
    let db = fresh_outbox().await;
    let stream = Stream::new().await;
    let args = nats_args(&stream);
    let (relay, all) =
        an_outage_charges_nothing(&db, &with(&args, &[]), 100, 2_000, NatsFrozen::freeze).await;
    let stored = stream.ids().await;
    for m in &all {
        assert_eq!(stored.get(&m.id), Some(&1), "message {} stored once", m.id);
    }
    assert_eq!(stored.len(), all.len());
    stops_cleanly(relay).await;
    stream.delete().await;
}

/// A trigger makes every `Sent` completion fail: the relay stops at once with a
/// non-zero exit instead of publishing and republishing messages whose outcome it
/// cannot record; nothing reaches the broker twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_the_database_rejects_stops_the_relay() {
    let _lock = faults::lock().await;
    let db = fresh_outbox().await;
    exec(
        &db,
        "CREATE FUNCTION {s}.refuse_sent() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'sent rows are refused by a trigger'; END $$",
    )
    .await;
    exec(
        &db,
        "CREATE TRIGGER refuse_sent BEFORE UPDATE ON {s}.outbox_messages
         FOR EACH ROW WHEN (NEW.status = 1) EXECUTE FUNCTION {s}.refuse_sent()",
    )
    .await;
    let fx = relay_fixture(FieldTable::default()).await;
    let counts = fx.counter().await;
    let msgs = orders(300, "refused");
    enqueue(&db, &msgs).await;
    let args = rabbit_args(&fx);
    let mut relay = RelayProcess::start(&db, &with(&args, &["--batch-size", "10"]));
    let status = relay.exited_within(Duration::from_secs(30)).await;
    let log = relay.log();
    assert!(
        status.is_some_and(|s| !s.success()),
        "the relay stops with an error: {status:?}\n{log}"
    );
    assert!(log.contains("sent rows are refused by a trigger"), "{log}");
    let arrived = quiet(&counts).await;
    assert!(
        !arrived.is_empty(),
        "it did publish before the completion failed"
    );
    assert!(
        arrived.values().all(|n| *n == 1),
        "nothing was published twice: {arrived:?}"
    );
    assert_eq!(count(&db, 1).await, 0, "no row could be marked sent");
    assert!(
        arrived.len() < 150,
        "it stopped claiming: {} of 300 published (batches of 10; at most the few in the pipeline)",
        arrived.len()
    );
    fx.delete_exchange().await;
}

/// SIGTERM while the NATS server is frozen: the relay stops within its drain timeout
/// instead of waiting out its (long) confirm timeout, and every row it held and could
/// not publish is `New` again, with no attempt charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_behind_a_frozen_broker_releases_within_the_drain_timeout() {
    let _lock = faults::lock().await;
    let db = fresh_outbox().await;
    let stream = Stream::new().await;
    let first = orders(10, "before-shutdown");
    enqueue(&db, &first).await;
    let args = nats_args(&stream);
    let mut relay = relay_warmed_up(
        &db,
        &with(
            &args,
            &[
                "--confirm-timeout",
                "30s",
                "--lease",
                "80s",
                "--drain-timeout",
                "2s",
                "--batch-size",
                "50",
            ],
        ),
        10,
    )
    .await;
    let frozen = NatsFrozen::freeze();
    enqueue(&db, &orders(300, "held")).await;
    wait_until(
        &relay,
        Duration::from_secs(30),
        "the relay holds rows",
        || async { count(&db, 9).await > 0 },
    )
    .await;
    let stopping = Instant::now();
    relay.terminate();
    let status = relay.exited_within(Duration::from_secs(20)).await;
    let took = stopping.elapsed();
    frozen.thaw();
    assert!(
        status.is_some_and(|s| s.success()),
        "clean exit: {status:?}\n{}",
        relay.log()
    );
    assert!(
        took < Duration::from_secs(8),
        "stopped {took:?} after SIGTERM; the drain timeout is 2 s\n{}",
        relay.log()
    );
    assert_eq!(count(&db, 9).await, 0, "nothing is left Processing");
    assert_eq!(count(&db, 0).await, 300, "the held rows are New again");
    assert_eq!(
        scalar(
            &db,
            "SELECT coalesce(max(attempts), 0)::int8 FROM {s}.outbox_messages WHERE status = 0"
        )
        .await,
        0,
        "no attempt was charged"
    );
    stream.delete().await;
}
