//! `outbox relay --source wal` as its own process, against the real PostgreSQL
//! (`wal_level = logical`) and RabbitMQ, no mocks:
//!
//! - (a) every message enqueued is published and marked Sent, and the slot's confirmed
//!   position moves past the producers' commits; SIGTERM stops it cleanly;
//! - (b) the relay killed with `SIGKILL` mid-run and started again: every id arrives at
//!   least once, none is missing;
//! - (c) the broker unreachable (the relay talks to RabbitMQ through a proxy of the
//!   test's, which is cut and restored): reading pauses, nothing goes dead, everything
//!   arrives once the broker is back;
//! - (d) a second relay on the same slot stands by and takes over when the first is
//!   killed;
//! - (e) the slot dropped under a running relay stops it loudly, and a relay without a
//!   slot does not start;
//! - (f) an idle outbox does not make the slot retain WAL (keepalives confirm the
//!   server's position), and the retained WAL is in /healthz and /metrics;
//! - (g) a row that cannot be published goes dead alone, the stream goes on, and its
//!   replay (`outbox dead replay`, an update back to New) is published;
//! - (i) SIGTERM mid-run: the relay drains and exits 0, its successor sends the rest,
//!   nothing is lost and nothing is published twice;
//! - (j) a row that makes the relay process die (the binary's abort hook), among 19
//!   healthy ones, the relay restarted each time: that row ends `Dead` as a suspected
//!   crash loop after the limit, the others are each published once;
//! - (k) the replication connection terminated by the server (`pg_terminate_backend`)
//!   mid-run: the relay reconnects and resumes, nothing is lost;
//! - (l) a full queue (RabbitMQ `reject-publish`): what it refuses is parked (the slot
//!   moves on), nothing goes dead or is charged, and once a consumer drains the queue
//!   everything arrives, each ordering key's first deliveries in commit order
//!   (`--ordering per-key-skip`);
//! - (o) a transaction the WAL already holds but other sessions cannot see yet (its
//!   commit waits for a synchronous standby that never answers): the relay neither
//!   publishes it nor confirms past it until it is visible, then publishes it and
//!   records it `Sent` (takes the fault lock: it holds every commit of the server for
//!   seconds);
//! - (n) a delayed message (`visible_at` ahead) is not published before its time, the
//!   later message of its key waits behind it, another key goes at once;
//! - (m) `--sent-retention delete`: each published row is deleted, a restart loses
//!   nothing;
//! - (h) over NATS JetStream, the relay killed mid-run and restarted: the stream holds
//!   every message exactly once (`Nats-Msg-Id` deduplication absorbs repeats).
//! - (p) `outbox wal setup --failover`: a failover slot from PostgreSQL 17 on; before
//!   17 a typed refusal that creates nothing (this machine's server is 15: only the
//!   refusal runs here);
//! - (q) a slot created without failover is neither dropped nor changed by a later
//!   `setup --failover`;
//! - (r) a publication made by hand without the outbox table, or publishing inserts
//!   only: the relay refuses to start (exit 1) and the slot is not confirmed past the
//!   rows pending, and `outbox wal setup` refuses it too, creating nothing;
//! - (s) the slot invalidated by PostgreSQL (`max_slot_wal_keep_size`) while the relay
//!   is paused by a broker outage: the relay stops on its own with a typed error
//!   (exit code 1) saying how to start over, its health says why, and the binary then
//!   refuses to start on that slot;
//! - (t) RabbitMQ frozen (`SIGSTOP`), the relay killed and started again six times
//!   (crash-loop limit 5): no restart counts as a crash of the message it was about to
//!   publish (the guard counts it only once the broker is ready); resumed, every
//!   message is published once and none is dead;
//! - (u) PostgreSQL stopped for longer than `stuck_after` and started again: a server
//!   restarting is transient, so the relay retries, its health says why meanwhile,
//!   and it resumes;
//! - (v) 10,001 messages delayed an hour, then one delayed 2 s: the 2 s one is sent
//!   within 10 s of coming due (the sweeper once looked at the 10,000 parked rows
//!   with the lowest `seq` only);
//! - (w) the relay's clock 1 s behind the database's (libfaketime, skipped with a
//!   message when it is not installed): no ordinary message is parked, commit to
//!   `sent_at` p99 within 2x of the same run without the skew; (x) 1 s ahead: no
//!   delayed message is received before its `visible_at`;
//! - (y) 3,000 routing keys to one full queue: at most 1,000 circuits open, refused
//!   trials at most 15 a second, the relay's memory bounded, and everything sent once
//!   the queue is drained (100,000 routing keys in the scale lane).
//!
//! Each test has a schema, a slot and a publication of its own; a guard drops all three
//! when the test ends, also when it panics (a forgotten slot retains WAL forever). The
//! shared servers are not touched, but by (o), (s), (t) and (u), which take the
//! machine-wide fault lock.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{
    RelayProcess, TestOutbox, WalCleanup, amqp_url, enqueue, eventually, fresh_outbox, message,
    outbox_command, scalar, wait_until, wal_command,
};
use lapin::types::FieldTable;
use outboxkit_cli::testing::internals::{DbSettings, Relay, RelaySettings, SourceKind};
use outboxkit_core::TransportKind;
use outboxkit_postgres::PgOutbox;
use outboxkit_rabbit::lapin;
use outboxkit_testkit::pg::ParkLog;
use outboxkit_testkit::rabbit::{Fixture, relay_fixture};
use sqlx::AssertSqlSafe;
use tokio::task::JoinHandle;

/// A fresh schema with its slot and publication set up (through `outbox wal setup`).
async fn wal_outbox() -> (TestOutbox, WalCleanup) {
    let db = fresh_outbox().await;
    let cleanup = WalCleanup::setup(&db);
    (db, cleanup)
}

async fn count(db: &PgOutbox, status: i16) -> i64 {
    scalar(
        db,
        &format!("SELECT count(*) FROM {{s}}.outbox_messages WHERE status = {status}"),
    )
    .await
}

/// Whether the slot's confirmed position is at or past `lsn`.
async fn confirmed_past(db: &PgOutbox, lsn: &str) -> bool {
    sqlx::query_scalar::<_, bool>(
        "SELECT coalesce(confirmed_flush_lsn >= $2::pg_lsn, false) FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(format!("{}_outbox", db.schema()))
    .bind(lsn)
    .fetch_optional(db.pool())
    .await
    .expect("slot")
    .unwrap_or(false)
}

async fn current_lsn(db: &PgOutbox) -> String {
    sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(db.pool())
        .await
        .expect("lsn")
}

async fn active_pid(db: &PgOutbox) -> Option<i32> {
    sqlx::query_scalar::<_, Option<i32>>(
        "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(format!("{}_outbox", db.schema()))
    .fetch_optional(db.pool())
    .await
    .expect("slot")
    .flatten()
}

fn relay_args(fx: &Fixture, broker_url: &str) -> Vec<String> {
    [
        "--source",
        "wal",
        "--transport",
        "rabbit",
        "--broker-url",
        broker_url,
        "--exchange",
        &fx.exchange,
        "--connect-timeout",
        "1s",
        "--confirm-timeout",
        "2s",
        "--lease",
        "6s",
        "--health-interval",
        "1s",
    ]
    .map(str::to_owned)
    .to_vec()
}

fn start(db: &PgOutbox, args: &[String]) -> RelayProcess {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    RelayProcess::start(db, &args)
}

/// Enqueues `n` messages in transactions of `per_tx`; returns their ids.
async fn enqueue_n(db: &PgOutbox, n: usize, per_tx: usize, tag: &str) -> Vec<String> {
    let mut ids = Vec::with_capacity(n);
    let all: Vec<_> = (0..n)
        .map(|i| message("OrderPlaced", "t", &format!("{tag}-{i}")))
        .collect();
    for chunk in all.chunks(per_tx) {
        enqueue(db, chunk).await;
        ids.extend(chunk.iter().map(|m| m.id.to_string()));
    }
    ids
}

fn missing(counts: &Mutex<std::collections::HashMap<String, usize>>, ids: &[String]) -> usize {
    let counts = counts.lock().expect("lock");
    ids.iter().filter(|id| !counts.contains_key(*id)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sends_everything_and_confirms_the_slot() {
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let counts = fx.counter().await;
    let mut relay = start(&db, &relay_args(&fx, &amqp_url()));
    let ids = enqueue_n(&db, 300, 30, "a").await;
    let after = current_lsn(&db).await;
    wait_until(
        &relay,
        Duration::from_secs(60),
        "all 300 are sent",
        || async { count(&db, 1).await == 300 && missing(&counts, &ids) == 0 },
    )
    .await;
    wait_until(
        &relay,
        Duration::from_secs(20),
        "the slot's confirmed position passes the producers' commits",
        || async { confirmed_past(&db, &after).await },
    )
    .await;
    assert_eq!(count(&db, 3).await, 0, "nothing dead");
    let (ok, status) = wal_command(&db, &["status", "--json"]);
    assert!(ok, "{status}");
    assert!(status.contains("\"slot_exists\": true"), "{status}");
    assert!(
        status.contains("\"notify_trigger_enabled\": false"),
        "{status}"
    );
    relay.terminate();
    let exit = relay.exited_within(Duration::from_secs(15)).await;
    assert!(
        exit.is_some_and(|s| s.success()),
        "a clean stop on SIGTERM: {exit:?}; log:\n{}",
        relay.log()
    );
    assert_eq!(active_pid(&db).await, None, "the slot is released");
    fx.delete_exchange().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b_a_relay_killed_mid_run_loses_nothing() {
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let counts = fx.counter().await;
    let args = relay_args(&fx, &amqp_url());
    let mut relay = start(&db, &args);
    // Enqueued while the relay runs, in many transactions.
    let producer = {
        let db = db.clone();
        tokio::spawn(async move { enqueue_n(&db, 2000, 20, "b").await })
    };
    wait_until(
        &relay,
        Duration::from_secs(60),
        "some are published",
        || async { counts.lock().expect("lock").len() >= 200 },
    )
    .await;
    relay.kill_9();
    assert!(relay.exited_within(Duration::from_secs(10)).await.is_some());
    let ids = producer.await.expect("producer");
    relay = start(&db, &args);
    wait_until(
        &relay,
        Duration::from_secs(120),
        "every id arrives after the restart",
        || async { missing(&counts, &ids) == 0 && count(&db, 1).await == 2000 },
    )
    .await;
    assert_eq!(count(&db, 3).await, 0, "nothing dead");
    let deliveries: usize = counts.lock().expect("lock").values().sum();
    eprintln!(
        "2000 messages, {deliveries} deliveries ({} duplicates after the kill); the restarted relay {}",
        deliveries - 2000,
        if relay
            .log()
            .contains("skipped rows the previous session published")
        {
            "skipped rows its predecessor had recorded but not confirmed"
        } else {
            "had nothing to skip"
        }
    );
    relay.terminate();
    assert!(relay.exited_within(Duration::from_secs(15)).await.is_some());
    fx.delete_exchange().await;
}

/// A TCP proxy to RabbitMQ that the test cuts (every connection closed, new ones
/// refused) and restores.
struct Proxy {
    port: u16,
    up: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Proxy {
    async fn start(target: SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let up = Arc::new(AtomicBool::new(true));
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = {
            let (up, conns) = (Arc::clone(&up), Arc::clone(&conns));
            tokio::spawn(async move {
                while let Ok((mut client, _)) = listener.accept().await {
                    if !up.load(Ordering::SeqCst) {
                        drop(client);
                        continue;
                    }
                    let task = tokio::spawn(async move {
                        if let Ok(mut server) = tokio::net::TcpStream::connect(target).await {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        }
                    });
                    conns.lock().expect("lock").push(task);
                }
            })
        };
        Self {
            port,
            up,
            conns,
            accept,
        }
    }

    fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        for task in self.conns.lock().expect("lock").drain(..) {
            task.abort();
        }
    }

    fn restore(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c_a_broker_outage_pauses_without_loss() {
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let counts = fx.counter().await;
    let proxy = Proxy::start("127.0.0.1:5672".parse().expect("addr")).await;
    let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port);
    let relay = start(&db, &relay_args(&fx, &url));
    let first = enqueue_n(&db, 20, 10, "c1").await;
    wait_until(
        &relay,
        Duration::from_secs(60),
        "the first 20 are sent",
        || async { count(&db, 1).await == 20 },
    )
    .await;

    proxy.cut();
    let second = enqueue_n(&db, 100, 10, "c2").await;
    wait_until(
        &relay,
        Duration::from_secs(30),
        "the relay notices the outage",
        || async { relay.log().contains("reading pauses") },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(count(&db, 3).await, 0, "an outage kills nothing");
    assert_eq!(count(&db, 0).await, 100, "the 100 wait");

    proxy.restore();
    wait_until(
        &relay,
        Duration::from_secs(90),
        "everything arrives once the broker is back",
        || async {
            count(&db, 1).await == 120 && missing(&counts, &first) + missing(&counts, &second) == 0
        },
    )
    .await;
    assert_eq!(count(&db, 3).await, 0, "nothing dead");
    assert!(relay.log().contains("reading resumes"), "{}", relay.log());
    relay.terminate();
    let mut relay = relay;
    assert!(relay.exited_within(Duration::from_secs(15)).await.is_some());
    fx.delete_exchange().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d_a_standby_takes_over_when_the_reader_dies() {
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let counts = fx.counter().await;
    let args = relay_args(&fx, &amqp_url());
    let mut first = start(&db, &args);
    wait_until(
        &first,
        Duration::from_secs(30),
        "the first relay reads the slot",
        || async {
            active_pid(&db).await.is_some() && first.log().contains("reading the replication slot")
        },
    )
    .await;
    let mut second = start(&db, &args);
    wait_until(
        &second,
        Duration::from_secs(30),
        "the second relay stands by",
        || async { second.log().contains("standing by") },
    )
    .await;
    let before = enqueue_n(&db, 50, 10, "d1").await;
    wait_until(
        &first,
        Duration::from_secs(60),
        "the first relay sends them",
        || async { missing(&counts, &before) == 0 },
    )
    .await;
    assert!(
        !second.log().contains("reading the replication slot"),
        "one reader at a time; second's log:\n{}",
        second.log()
    );

    first.kill_9();
    assert!(first.exited_within(Duration::from_secs(10)).await.is_some());
    let after = enqueue_n(&db, 50, 10, "d2").await;
    wait_until(
        &second,
        Duration::from_secs(60),
        "the standby takes over and sends the rest",
        || async { missing(&counts, &after) == 0 && count(&db, 1).await == 100 },
    )
    .await;
    assert!(second.log().contains("reading the replication slot"));
    second.terminate();
    assert!(
        second
            .exited_within(Duration::from_secs(15))
            .await
            .is_some()
    );
    fx.delete_exchange().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e_a_dropped_slot_stops_the_relay_loudly() {
    // Without a slot the relay does not start.
    let db = fresh_outbox().await;
    let _cleanup = WalCleanup {
        schema: db.schema().to_owned(),
    };
    let fx = relay_fixture(FieldTable::default()).await;
    let args = relay_args(&fx, &amqp_url());
    let mut relay = start(&db, &args);
    let exit = relay.exited_within(Duration::from_secs(20)).await;
    assert!(
        exit.is_some_and(|s| s.code() == Some(1)),
        "{exit:?}; log:\n{}",
        relay.log()
    );
    assert!(relay.log().contains("does not exist"), "{}", relay.log());

    let (ok, out) = wal_command(&db, &["setup"]);
    assert!(ok, "{out}");
    let mut relay = start(&db, &args);
    wait_until(
        &relay,
        Duration::from_secs(30),
        "the relay reads the slot",
        || async { active_pid(&db).await.is_some() },
    )
    .await;
    let (ok, out) = wal_command(&db, &["drop"]);
    assert!(
        !ok && out.contains("in use"),
        "drop refuses a slot in use: {out}"
    );
    let (ok, out) = wal_command(&db, &["drop", "--force"]);
    assert!(ok, "{out}");
    let exit = relay.exited_within(Duration::from_secs(30)).await;
    assert!(
        exit.is_some_and(|s| s.code() == Some(1)),
        "the relay stops with an error: {exit:?}; log:\n{}",
        relay.log()
    );
    let log = relay.log();
    assert!(
        log.contains("does not exist") && log.contains("outbox wal setup"),
        "a clear error: {log}"
    );
    let (ok, status) = wal_command(&db, &["status"]);
    assert!(ok && status.contains("missing"), "{status}");
    fx.delete_exchange().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f_an_idle_outbox_does_not_retain_wal() {
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let relay = start(&db, &relay_args(&fx, &amqp_url()));
    wait_until(
        &relay,
        Duration::from_secs(30),
        "the relay reads the slot",
        || async { active_pid(&db).await.is_some() },
    )
    .await;
    // WAL written by other tables only: nothing for the relay to publish, but the slot
    // must not keep it.
    common::exec(&db, "CREATE TABLE {s}.other (n int)").await;
    common::exec(
        &db,
        "INSERT INTO {s}.other SELECT generate_series(1, 10000)",
    )
    .await;
    let after = current_lsn(&db).await;
    wait_until(
        &relay,
        Duration::from_secs(60),
        "the idle relay confirms the server's position",
        || async { confirmed_past(&db, &after).await },
    )
    .await;
    assert_eq!(count(&db, 1).await, 0);

    // The retained WAL is a gauge and part of /healthz.
    let addr = relay.addr().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (code, body) = common::http_get(addr, "/healthz").await;
        if code == 200 && body.contains("\"wal_retained_bytes\"") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "/healthz: {code} {body}; log:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (_, metrics) = common::http_get(addr, "/metrics").await;
    assert!(metrics.contains("outbox_wal_retained_bytes"), "{metrics}");
    relay.terminate();
    let mut relay = relay;
    assert!(relay.exited_within(Duration::from_secs(15)).await.is_some());
    fx.delete_exchange().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g_a_poison_row_dies_alone_and_a_replay_is_published() {
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let counts = fx.counter().await;
    let relay = start(&db, &relay_args(&fx, &amqp_url()));
    let before = enqueue_n(&db, 5, 5, "g1").await;
    // Headers that are not an object of strings: the row cannot be published.
    let poison = uuid::Uuid::now_v7();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {}.outbox_messages (id, aggregate_type, aggregate_id, event_type, payload, headers) \
         VALUES ($1, 'order', 'p', 'OrderPlaced', '{{}}', '{{\"n\": 1}}')",
        db.schema()
    )))
    .bind(poison)
    .execute(db.pool())
    .await
    .expect("insert the poison row");
    let after = enqueue_n(&db, 5, 5, "g2").await;
    wait_until(
        &relay,
        Duration::from_secs(60),
        "the good ones are sent, the poison one dead",
        || async { count(&db, 1).await == 10 && count(&db, 3).await == 1 },
    )
    .await;
    assert_eq!(missing(&counts, &before) + missing(&counts, &after), 0);
    let error: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT last_error FROM {}.outbox_messages WHERE id = $1",
        db.schema()
    )))
    .bind(poison)
    .fetch_one(db.pool())
    .await
    .expect("the poison row");
    assert!(
        error.as_deref().is_some_and(|e| e.contains("headers")),
        "{error:?}"
    );

    // Repaired and replayed: the update back to New comes through the slot.
    common::exec(
        &db,
        "UPDATE {s}.outbox_messages SET headers = '{}' WHERE status = 3",
    )
    .await;
    let id = poison.to_string();
    let (ok, out) = outbox_command(&db, &["dead", "replay", "--id", &id]);
    assert!(ok, "{out}");
    wait_until(
        &relay,
        Duration::from_secs(60),
        "the replayed message is sent",
        || async { count(&db, 1).await == 11 && counts.lock().expect("lock").contains_key(&id) },
    )
    .await;
    relay.terminate();
    let mut relay = relay;
    assert!(relay.exited_within(Duration::from_secs(15)).await.is_some());
    fx.delete_exchange().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h_over_nats_a_restart_leaves_every_message_once_in_the_stream() {
    let (db, _cleanup) = wal_outbox().await;
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let (stream, prefix) = (format!("TEST_{tag}"), format!("test.{tag}"));
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let config = outboxkit_nats::NatsConfig::new(&nats_url).with_subject_prefix(&prefix);
    outboxkit_nats::StreamSetup::for_config(&stream, &config)
        .with_storage(outboxkit_nats::Storage::Memory)
        .apply(&config)
        .await
        .expect("stream");
    let client = outboxkit_nats::async_nats::connect(&nats_url)
        .await
        .expect("connect");
    let js = outboxkit_nats::async_nats::jetstream::new(client);
    let args: Vec<String> = [
        "--source",
        "wal",
        "--transport",
        "nats",
        "--broker-url",
        &nats_url,
        "--subject-prefix",
        &prefix,
        "--connect-timeout",
        "1s",
        "--confirm-timeout",
        "2s",
        "--lease",
        "6s",
    ]
    .map(str::to_owned)
    .to_vec();
    let mut relay = start(&db, &args);
    let producer = {
        let db = db.clone();
        tokio::spawn(async move { enqueue_n(&db, 1000, 20, "h").await })
    };
    wait_until(&relay, Duration::from_secs(60), "some are sent", || async {
        count(&db, 1).await >= 100
    })
    .await;
    relay.kill_9();
    assert!(relay.exited_within(Duration::from_secs(10)).await.is_some());
    producer.await.expect("producer");
    relay = start(&db, &args);
    wait_until(
        &relay,
        Duration::from_secs(120),
        "all 1000 are sent",
        || async { count(&db, 1).await == 1000 },
    )
    .await;
    let messages = js
        .get_stream(&stream)
        .await
        .expect("stream")
        .info()
        .await
        .expect("info")
        .state
        .messages;
    let _ = js.delete_stream(&stream).await;
    assert_eq!(messages, 1000, "every message once in the stream");
    relay.terminate();
    assert!(relay.exited_within(Duration::from_secs(15)).await.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i_sigterm_mid_run_drains_and_a_successor_sends_the_rest() {
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let counts = fx.counter().await;
    let args = relay_args(&fx, &amqp_url());
    let mut relay = start(&db, &args);
    let producer = {
        let db = db.clone();
        tokio::spawn(async move { enqueue_n(&db, 2000, 20, "i").await })
    };
    wait_until(
        &relay,
        Duration::from_secs(60),
        "some are published",
        || async { counts.lock().expect("lock").len() >= 200 },
    )
    .await;
    relay.terminate();
    let exit = relay.exited_within(Duration::from_secs(15)).await;
    assert!(
        exit.is_some_and(|s| s.success()),
        "drained and exited 0: {exit:?}; log:\n{}",
        relay.log()
    );
    assert_eq!(active_pid(&db).await, None, "the slot is released");
    let ids = producer.await.expect("producer");
    relay = start(&db, &args);
    wait_until(
        &relay,
        Duration::from_secs(120),
        "every id arrives",
        || async { missing(&counts, &ids) == 0 && count(&db, 1).await == 2000 },
    )
    .await;
    // Deliveries settle: the consumer may lag the table by a moment.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let deliveries: usize = counts.lock().expect("lock").values().sum();
    assert_eq!(
        deliveries, 2000,
        "a drained relay leaves nothing to publish twice"
    );
    relay.terminate();
    assert!(relay.exited_within(Duration::from_secs(15)).await.is_some());
    fx.delete_exchange().await;
}

#[cfg(feature = "testing")] // the abort hook
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_a_row_that_kills_the_relay_dies_alone() {
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let counts = fx.counter().await;
    let mut args = relay_args(&fx, &amqp_url());
    args.extend(["--crash-loop-limit".to_owned(), "5".to_owned()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut rows: Vec<_> = (0..19)
        .map(|i| message("OrderPlaced", "t", &format!("j-{i}")))
        .collect();
    let crash = message("Crash", "t", "c");
    rows.insert(5, crash.clone());
    enqueue(&db, &rows).await;
    let start = || {
        RelayProcess::start_with_env(
            &db,
            &args,
            &[(outboxkit_cli::testing::ABORT_ON_EVENT_TYPE, "Crash")],
        )
    };
    let mut relay = start();
    let mut starts = 1;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        if count(&db, 3).await == 1 && count(&db, 1).await == 19 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "after {starts} starts: {} sent, {} dead; log:\n{}",
            count(&db, 1).await,
            count(&db, 3).await,
            relay.log()
        );
        if !relay.running() {
            relay = start();
            starts += 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let error: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT last_error FROM {}.outbox_messages WHERE id = $1",
        db.schema()
    )))
    .bind(crash.id)
    .fetch_one(db.pool())
    .await
    .expect("the crashing row");
    assert!(
        error
            .as_deref()
            .is_some_and(|e| e.starts_with("suspected crash loop: published alone 5 times")),
        "{error:?}"
    );
    assert!(starts >= 6, "one crash, then five alone: {starts} starts");
    wait_until(&relay, Duration::from_secs(10), "the 19 arrive", || async {
        counts.lock().expect("lock").len() == 19
    })
    .await;
    let deliveries: usize = counts.lock().expect("lock").values().sum();
    assert_eq!(deliveries, 19, "each healthy row published once");
    relay.terminate();
    assert!(relay.exited_within(Duration::from_secs(15)).await.is_some());
    fx.delete_exchange().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn k_a_lost_replication_connection_is_resumed() {
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let counts = fx.counter().await;
    let relay = start(&db, &relay_args(&fx, &amqp_url()));
    let producer = {
        let db = db.clone();
        tokio::spawn(async move { enqueue_n(&db, 1000, 10, "k").await })
    };
    wait_until(
        &relay,
        Duration::from_secs(60),
        "some are published",
        || async { counts.lock().expect("lock").len() >= 100 },
    )
    .await;
    let pid = active_pid(&db).await.expect("the relay reads the slot");
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .execute(db.pool())
        .await
        .expect("terminate the walsender");
    let ids = producer.await.expect("producer");
    wait_until(
        &relay,
        Duration::from_secs(120),
        "every id arrives",
        || async { missing(&counts, &ids) == 0 && count(&db, 1).await == 1000 },
    )
    .await;
    assert!(
        relay.log().contains("reconnecting"),
        "the relay saw the connection go: {}",
        relay.log()
    );
    let mut relay = relay;
    assert!(relay.running(), "a lost connection is not fatal");
    relay.terminate();
    assert!(relay.exited_within(Duration::from_secs(15)).await.is_some());
    fx.delete_exchange().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l_a_full_queue_parks_its_messages_without_loss() {
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(outboxkit_testkit::rabbit::reject_when_full(10)).await;
    // `per-key-skip`: first deliveries in order per key also when a batch meets the
    // queue full halfway (by default a later message of the key may overtake).
    let mut args = relay_args(&fx, &amqp_url());
    args.extend(["--ordering".to_owned(), "per-key-skip".to_owned()]);
    let relay = start(&db, &args);
    // 30 messages over three ordering keys, five to a transaction.
    let all: Vec<_> = (0..30)
        .map(|i| message("OrderPlaced", "t", &format!("l-{}", i % 3)))
        .collect();
    let key_of: std::collections::HashMap<String, String> = all
        .iter()
        .map(|m| (m.id.to_string(), m.aggregate_id.clone()))
        .collect();
    let mut ids = Vec::new();
    for chunk in all.chunks(5) {
        enqueue(&db, chunk).await;
        ids.extend(chunk.iter().map(|m| m.id.to_string()));
    }
    wait_until(
        &relay,
        Duration::from_secs(60),
        "the relay parks what the full queue refuses",
        || async { count(&db, 1).await == 10 && count(&db, 9).await == 20 },
    )
    .await;
    assert!(
        relay.log().contains("a destination refuses messages"),
        "{}",
        relay.log()
    );
    // The slot moves past parked rows: the table holds them now.
    let lsn = current_lsn(&db).await;
    wait_until(
        &relay,
        Duration::from_secs(30),
        "the slot is confirmed past them",
        || confirmed_past(&db, &lsn),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(count(&db, 3).await, 0, "a full queue kills nothing");
    assert_eq!(
        scalar(
            &db,
            "SELECT max(attempts)::bigint FROM {s}.outbox_messages WHERE status = 9"
        )
        .await,
        0,
        "refusals are not charged"
    );

    // A consumer drains the queue: the parked rows go, each key's in commit order. (Not
    // all in commit order: a batch of the sweeper may meet the queue full again, and
    // then only the refused message's key waits behind it.)
    let order = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&order);
    fx.consume(move |id, _| sink.lock().expect("lock").push(id))
        .await;
    wait_until(
        &relay,
        Duration::from_secs(90),
        "all 30 are sent",
        || async { count(&db, 1).await == 30 && order.lock().expect("lock").len() >= 30 },
    )
    .await;
    let got = order.lock().expect("lock").clone();
    let mut first_seen = Vec::new();
    for id in got {
        if !first_seen.contains(&id) {
            first_seen.push(id);
        }
    }
    let mut sorted = first_seen.clone();
    sorted.sort_unstable();
    let mut expected = ids.clone();
    expected.sort_unstable();
    assert_eq!(sorted, expected, "every message delivered");
    for key in ["l-0", "l-1", "l-2"] {
        let of_key = |v: &[String]| -> Vec<String> {
            v.iter().filter(|id| key_of[*id] == key).cloned().collect()
        };
        assert_eq!(
            of_key(&first_seen),
            of_key(&ids),
            "first deliveries of key {key} in commit order"
        );
    }
    assert_eq!(count(&db, 3).await, 0);
    assert_eq!(
        scalar(&db, "SELECT max(attempts)::bigint FROM {s}.outbox_messages").await,
        1,
        "each charged only its successful attempt"
    );
    relay.terminate();
    let mut relay = relay;
    assert!(relay.exited_within(Duration::from_secs(15)).await.is_some());
    fx.delete_exchange().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_a_delayed_message_waits_for_its_time_and_holds_only_its_key() {
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let order = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&order);
    fx.consume(move |id, _| sink.lock().expect("lock").push(id))
        .await;
    let relay = start(&db, &relay_args(&fx, &amqp_url()));
    let delay = Duration::from_secs(4);
    // Key a: a1, a2 (delayed), a3; key b: b1, all in one transaction.
    let a1 = message("OrderPlaced", "order", "a");
    let a2 = outboxkit_core::NewMessage::builder("order", "a", "OrderPlaced")
        .payload(&serde_json::json!({ "n": 2 }))
        .deliver_after(delay)
        .build()
        .expect("valid");
    let a3 = message("OrderPlaced", "order", "a");
    let b1 = message("OrderPlaced", "order", "b");
    let id = |m: &outboxkit_core::NewMessage| m.id.to_string();
    let (a1_id, a2_id, a3_id, b1_id) = (id(&a1), id(&a2), id(&a3), id(&b1));
    enqueue(&db, &[a1, a2, a3, b1]).await;
    let enqueued = std::time::Instant::now();
    wait_until(
        &relay,
        Duration::from_secs(30),
        "a1 and b1 are sent",
        || async { count(&db, 1).await == 2 },
    )
    .await;
    let seen = order.lock().expect("lock").clone();
    assert!(
        seen.contains(&a1_id)
            && seen.contains(&b1_id)
            && !seen.contains(&a2_id)
            && !seen.contains(&a3_id),
        "the delayed message and the one behind it on its key wait; the other key goes: {seen:?}"
    );
    assert!(
        enqueued.elapsed() < delay,
        "checked before the delay ran out"
    );
    wait_until(
        &relay,
        Duration::from_secs(30),
        "all four are sent",
        || async { count(&db, 1).await == 4 && order.lock().expect("lock").len() >= 4 },
    )
    .await;
    let seen = order.lock().expect("lock").clone();
    let at = |x: &str| seen.iter().position(|s| s == x).expect("delivered");
    assert!(
        at(&a1_id) < at(&a2_id) && at(&a2_id) < at(&a3_id),
        "key a in order: {seen:?}"
    );
    let early: i64 = scalar(
        &db,
        "SELECT count(*) FROM {s}.outbox_messages WHERE sent_at < visible_at",
    )
    .await;
    assert_eq!(early, 0, "nothing is sent before its visible_at");
    relay.terminate();
    let mut relay = relay;
    assert!(relay.exited_within(Duration::from_secs(15)).await.is_some());
    fx.delete_exchange().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn m_sent_retention_delete_removes_published_rows() {
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let counts = fx.counter().await;
    let mut args = relay_args(&fx, &amqp_url());
    args.extend(["--sent-retention".to_owned(), "delete".to_owned()]);
    let total = || async { scalar(&db, "SELECT count(*) FROM {s}.outbox_messages").await };
    let mut relay = start(&db, &args);
    let first = enqueue_n(&db, 500, 50, "m1").await;
    wait_until(
        &relay,
        Duration::from_secs(60),
        "the first 500 are sent and deleted",
        || async { total().await == 0 && missing(&counts, &first) == 0 },
    )
    .await;
    relay.kill_9();
    assert!(relay.exited_within(Duration::from_secs(10)).await.is_some());
    let second = enqueue_n(&db, 500, 50, "m2").await;
    relay = start(&db, &args);
    wait_until(
        &relay,
        Duration::from_secs(60),
        "the rest after a restart",
        || async { total().await == 0 && missing(&counts, &second) == 0 },
    )
    .await;
    let deliveries: usize = counts.lock().expect("lock").values().sum();
    assert_eq!(deliveries, 1000, "deleted rows are not published again");
    relay.terminate();
    assert!(relay.exited_within(Duration::from_secs(15)).await.is_some());
    fx.delete_exchange().await;
}

/// While set, `synchronous_standby_names` names a standby that never connects: every
/// commit of the server waits after its commit record is written to the WAL, invisible
/// to other sessions (the logical walsender decodes and sends it meanwhile). Reset, and
/// the configuration reloaded, when dropped (also on panic): the waiting commits
/// return.
struct NoSyncStandby;

impl NoSyncStandby {
    async fn set(db: &PgOutbox) -> Self {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {}.sync_probe (x int)",
            db.schema()
        )))
        .execute(db.pool())
        .await
        .expect("probe table");
        for sql in [
            "ALTER SYSTEM SET synchronous_standby_names = 'outbox_test_nobody'",
            "SELECT pg_reload_conf()",
        ] {
            sqlx::query(sql).execute(db.pool()).await.expect(sql);
        }
        let this = Self;
        // In force once the checkpointer has read the reloaded configuration: a probe
        // commit (of a row: a commit that wrote no WAL does not wait) on a connection of
        // its own then hangs until the guard resets the setting.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let pool = db.pool().clone();
            let insert = format!("INSERT INTO {}.sync_probe VALUES (1)", db.schema());
            let probe = tokio::spawn(async move {
                let _ = sqlx::query(sqlx::AssertSqlSafe(insert))
                    .execute(&pool)
                    .await;
            });
            tokio::time::sleep(Duration::from_millis(300)).await;
            if !probe.is_finished() {
                return this;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "synchronous_standby_names never took effect"
            );
        }
    }
}

impl Drop for NoSyncStandby {
    fn drop(&mut self) {
        let done = outboxkit_testkit::on_own_runtime(async {
            let pool = sqlx::PgPool::connect(&common::database_url())
                .await
                .expect("connect");
            for sql in [
                "ALTER SYSTEM RESET synchronous_standby_names",
                "SELECT pg_reload_conf()",
            ] {
                sqlx::query(sql).execute(&pool).await.expect(sql);
            }
        });
        if !done {
            eprintln!(
                "synchronous_standby_names NOT reset: run ALTER SYSTEM RESET synchronous_standby_names; SELECT pg_reload_conf()"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o_a_commit_not_yet_visible_is_recorded_once_it_is() {
    let _lock = outboxkit_testkit::faults::lock().await;
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let got = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&got);
    fx.consume(move |id, _| sink.lock().expect("lock").push(id))
        .await;
    let relay = start(&db, &relay_args(&fx, &amqp_url()));
    // The relay is reading: one message goes through first.
    let first = enqueue_n(&db, 1, 1, "o-first").await;
    wait_until(
        &relay,
        Duration::from_secs(30),
        "the first message is sent",
        || async { count(&db, 1).await == 1 },
    )
    .await;

    let standby = NoSyncStandby::set(&db).await;
    let m = message("OrderPlaced", "t", "o-hidden");
    let id = m.id.to_string();
    let producer = {
        let db = db.clone();
        tokio::spawn(async move { enqueue(&db, &[m]).await })
    };
    // The commit is in the WAL but waits for the standby, invisible to other
    // sessions: the relay neither publishes it nor confirms past it.
    // (Its commit record is in the WAL by now: this position is past it.)
    tokio::time::sleep(Duration::from_secs(1)).await;
    let lsn = current_lsn(&db).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !producer.is_finished(),
        "the producer's commit is still waiting"
    );
    assert!(
        !got.lock().expect("lock").contains(&id),
        "not published before it is visible"
    );
    assert!(!confirmed_past(&db, &lsn).await, "not confirmed past it");
    drop(standby);
    producer.await.expect("the producer's commit returns");
    wait_until(
        &relay,
        Duration::from_secs(30),
        "the hidden message is published",
        || async { got.lock().expect("lock").contains(&id) },
    )
    .await;

    wait_until(
        &relay,
        Duration::from_secs(30),
        "the hidden message is recorded Sent",
        || async { count(&db, 1).await == 2 },
    )
    .await;
    assert_eq!(count(&db, 0).await, 0, "nothing left New behind the slot");
    assert_eq!(first.len(), 1);
    relay.terminate();
    let mut relay = relay;
    assert!(relay.exited_within(Duration::from_secs(15)).await.is_some());
    fx.delete_exchange().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p_a_failover_slot_is_created_from_postgresql_17_and_refused_before() {
    let db = fresh_outbox().await;
    let _cleanup = WalCleanup {
        schema: db.schema().to_owned(),
    };
    let version = scalar(&db, "SELECT current_setting('server_version_num')::bigint").await;
    let (ok, out) = wal_command(&db, &["setup", "--failover"]);
    let (_, status) = wal_command(&db, &["status", "--json"]);
    let status: serde_json::Value = serde_json::from_str(&status).expect(&status);
    if version < 170_000 {
        assert!(
            !ok && out.contains("PostgreSQL 17") && out.contains("nothing was created"),
            "a clear refusal: {out}"
        );
        assert_eq!(status["slot_exists"], false, "{status}");
        assert_eq!(status["publication_exists"], false, "{status}");
        assert_eq!(status["notify_trigger_enabled"], true, "{status}");
        // Without --failover the same setup goes through; the slot says it has none.
        let (ok, out) = wal_command(&db, &["setup"]);
        assert!(ok, "{out}");
        let (_, status) = wal_command(&db, &["status"]);
        assert!(status.contains("failover slot:        -"), "{status}");
    } else {
        assert!(ok && out.contains("(failover)"), "{out}");
        assert_eq!(status["failover"], true, "{status}");
        // Asked again of the slot it created: nothing to do.
        let (ok, out) = wal_command(&db, &["setup", "--failover"]);
        assert!(ok && out.contains("exists (failover)"), "{out}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q_failover_is_not_set_behind_the_operators_back() {
    // A slot created without failover is neither dropped nor changed by a later
    // `setup --failover` (a new slot would start at the current position).
    let (db, _cleanup) = wal_outbox().await;
    let version = scalar(&db, "SELECT current_setting('server_version_num')::bigint").await;
    let before = scalar(
        &db,
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{s}_outbox'",
    )
    .await;
    assert_eq!(before, 1);
    let (ok, out) = wal_command(&db, &["setup", "--failover"]);
    assert!(!ok, "{out}");
    if version >= 170_000 {
        assert!(out.contains("ALTER_REPLICATION_SLOT"), "{out}");
    } else {
        assert!(out.contains("PostgreSQL 17"), "{out}");
    }
    let (_, status) = wal_command(&db, &["status", "--json"]);
    let status: serde_json::Value = serde_json::from_str(&status).expect(&status);
    assert_eq!(status["slot_exists"], true, "{status}");
    assert_ne!(status["failover"], true, "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r_a_publication_without_the_table_or_its_updates_is_refused() {
    // A publication made by hand (here under the default name, so that `setup` and the
    // relay take it), and a slot: with the outbox table missing from it, or with its
    // updates (replayed dead letters) missing, the relay would confirm the slot past
    // rows it never receives.
    let fx = relay_fixture(FieldTable::default()).await;
    for (what, publication) in [
        ("without the outbox table", "FOR TABLE {s}.other"),
        (
            "with inserts only",
            "FOR TABLE {s}.outbox_messages WITH (publish = 'insert')",
        ),
    ] {
        let db = fresh_outbox().await;
        let _cleanup = WalCleanup {
            schema: db.schema().to_owned(),
        };
        common::exec(&db, "CREATE TABLE {s}.other (n int)").await;
        common::exec(
            &db,
            &format!("CREATE PUBLICATION {{s}}_outbox {publication}"),
        )
        .await;
        common::exec(
            &db,
            "SELECT pg_create_logical_replication_slot('{s}_outbox', 'pgoutput')",
        )
        .await;
        let slot_at = scalar(
            &db,
            "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots WHERE slot_name = '{s}_outbox'",
        )
        .await;
        enqueue_n(&db, 5, 5, "r").await;
        let after = current_lsn(&db).await;
        let mut relay = start(&db, &relay_args(&fx, &amqp_url()));
        let exit = relay.exited_within(Duration::from_secs(20)).await;
        let confirmed = scalar(
            &db,
            "SELECT (confirmed_flush_lsn - '0/0')::bigint FROM pg_replication_slots WHERE slot_name = '{s}_outbox'",
        )
        .await;
        assert!(
            exit.is_some_and(|s| s.code() == Some(1)),
            "{what}: the relay refuses to start: {exit:?} (slot confirmed past the 5 pending rows: {}); log:\n{}",
            confirmed_past(&db, &after).await,
            relay.log()
        );
        assert_eq!(confirmed, slot_at, "{what}: the slot did not move");
        let log = relay.log();
        assert!(
            log.contains("inserts and updates") && log.contains("outbox wal drop"),
            "{what}: a clear error: {log}"
        );
        assert_eq!(count(&db, 0).await, 5, "{what}: the rows stay pending");

        // `outbox wal setup` refuses it too (the slot dropped first: nothing created).
        common::exec(&db, "SELECT pg_drop_replication_slot('{s}_outbox')").await;
        let (ok, out) = wal_command(&db, &["setup"]);
        assert!(
            !ok && out.contains("inserts and updates"),
            "{what}: setup refuses: {out}"
        );
        let (_, status) = wal_command(&db, &["status", "--json"]);
        let status: serde_json::Value = serde_json::from_str(&status).expect(&status);
        assert_eq!(status["slot_exists"], false, "{what}: {status}");
    }
    fx.delete_exchange().await;
}

/// The settings of `relay_args` for a relay in this process (`Relay::start`), its
/// health checked every 200 ms.
fn in_process(db: &PgOutbox, fx: &Fixture, broker_url: &str) -> RelaySettings {
    let mut settings = RelaySettings::new(
        DbSettings {
            url: common::database_url(),
            schema: db.schema().to_owned(),
        },
        TransportKind::Rabbit,
        broker_url,
    );
    settings.exchange = fx.exchange.clone();
    settings.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    settings.source = SourceKind::Wal;
    settings.health_interval = Duration::from_millis(200);
    settings.connect_timeout = Duration::from_secs(1);
    settings.confirm_timeout = Duration::from_secs(2);
    settings.lease = Duration::from_secs(6);
    settings
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s_an_invalidated_slot_stops_the_relay_and_healthz_says_why() {
    // The relay (in this process, to read its health after it stopped) paused by a
    // broker outage while its slot is invalidated by PostgreSQL (`max_slot_wal_keep_size`
    // passed): it stops on its own, and the binary then refuses to start on that slot.
    let _lock = outboxkit_testkit::faults::lock().await;
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let proxy = Proxy::start("127.0.0.1:5672".parse().expect("addr")).await;
    let settings = in_process(
        &db,
        &fx,
        &format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port),
    );
    let stop = tokio_util::sync::CancellationToken::new();
    let relay = Relay::start(&settings, stop.clone())
        .await
        .expect("relay starts");
    let health = relay.health().clone();
    enqueue_n(&db, 10, 10, "s1").await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&db, 1).await == 10
        })
        .await,
        "the first 10 are sent"
    );
    proxy.cut();
    enqueue_n(&db, 10, 10, "s2").await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            health.report().circuit_open
        })
        .await,
        "the relay pauses for the outage: {:?}",
        health.report()
    );

    outboxkit_testkit::slot::invalidate(
        db.pool(),
        &common::database_url(),
        &format!("{}_outbox", db.schema()),
    )
    .await;
    let stopped = tokio::time::timeout(Duration::from_secs(30), relay.wait()).await;
    stop.cancel();
    let error = match stopped {
        Ok(Err(e)) => e,
        Ok(Ok(stats)) => panic!("the relay stopped without an error: {stats:?}"),
        Err(_) => panic!(
            "the relay still runs 30 s after its slot was invalidated: {:?}",
            health.report()
        ),
    };
    assert_eq!(error.exit_code(), 1, "{error}");
    let text = error.to_string();
    assert!(
        text.contains("invalidated") && text.contains("outbox wal drop"),
        "{text}"
    );
    let report = health.report();
    assert!(
        report
            .reasons
            .iter()
            .any(|r| r.starts_with("relay stopped:") && r.contains("invalidated")),
        "/healthz says why: {report:?}"
    );
    assert_eq!(count(&db, 0).await, 10, "the 10 stay pending, nothing lost");

    // Started again, the binary refuses the slot at once.
    let mut relay = start(&db, &relay_args(&fx, &amqp_url()));
    let exit = relay.exited_within(Duration::from_secs(20)).await;
    assert!(
        exit.is_some_and(|s| s.code() == Some(1)),
        "{exit:?}; log:\n{}",
        relay.log()
    );
    assert!(relay.log().contains("invalidated"), "{}", relay.log());
    let (ok, status) = wal_command(&db, &["status"]);
    assert!(ok && status.contains("lost"), "{status}");
    fx.delete_exchange().await;
}

/// The highest crash-loop count (`unfinished_alone`) in the table.
async fn alone(db: &PgOutbox) -> i64 {
    scalar(
        db,
        "SELECT coalesce(max(unfinished_alone), 0)::bigint FROM {s}.outbox_messages",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t_restarts_while_the_broker_is_frozen_count_no_crash() {
    // RabbitMQ frozen (`SIGSTOP`), 100 messages committed, the relay started and
    // killed (`SIGKILL`) six times (crash-loop limit 5), each time once it has begun
    // its session, then RabbitMQ resumed: a restart while the broker cannot take
    // messages is not a crash of the message it was about to publish.
    let _lock = outboxkit_testkit::faults::lock().await;
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let counts = fx.counter().await;
    let mut args = relay_args(&fx, &amqp_url());
    args.extend(["--crash-loop-limit".to_owned(), "5".to_owned()]);
    let mut relay = start(&db, &args);
    let warm = enqueue_n(&db, 1, 1, "t-warm").await;
    wait_until(
        &relay,
        Duration::from_secs(30),
        "the warm-up is sent",
        || async { count(&db, 1).await == 1 },
    )
    .await;
    relay.kill_9();
    assert!(relay.exited_within(Duration::from_secs(10)).await.is_some());

    let frozen = outboxkit_testkit::faults::RabbitFrozen::try_freeze().expect("freeze RabbitMQ");
    let ids = enqueue_n(&db, 100, 10, "t").await;
    let mut counted = Vec::new();
    for round in 1..=6 {
        relay = start(&db, &args);
        // Until it has counted its first message (the guard) or paused for the broker.
        wait_until(
            &relay,
            Duration::from_secs(30),
            "the restarted relay counts its first message or pauses",
            || async { alone(&db).await >= round || relay.log().contains("reading pauses") },
        )
        .await;
        counted.push(alone(&db).await);
        relay.kill_9();
        assert!(relay.exited_within(Duration::from_secs(10)).await.is_some());
    }
    drop(frozen);

    relay = start(&db, &args);
    wait_until(
        &relay,
        Duration::from_secs(60),
        "every row is published or dead",
        || async { count(&db, 1).await + count(&db, 3).await == 101 },
    )
    .await;
    assert_eq!(
        count(&db, 3).await,
        0,
        "nothing dead (the guard's count after each restart: {counted:?})"
    );
    wait_until(
        &relay,
        Duration::from_secs(30),
        "all 101 arrive",
        || async { missing(&counts, &ids) + missing(&counts, &warm) == 0 },
    )
    .await;
    let deliveries: usize = counts.lock().expect("lock").values().sum();
    assert_eq!(deliveries, 101, "each message published once");
    relay.terminate();
    assert!(relay.exited_within(Duration::from_secs(15)).await.is_some());
    fx.delete_exchange().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn u_a_server_restart_is_retried_and_healthz_says_why() {
    // PostgreSQL stopped for longer than `stuck_after` under a running relay (in this
    // process, to read its health): a server restarting is transient, so the relay
    // retries, its health says why meanwhile, and once the server is back it resumes.
    let _lock = outboxkit_testkit::faults::lock().await;
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let counts = fx.counter().await;
    let mut settings = in_process(&db, &fx, &amqp_url());
    settings.stuck_after = Duration::from_secs(2);
    let stop = tokio_util::sync::CancellationToken::new();
    let relay = Relay::start(&settings, stop.clone())
        .await
        .expect("relay starts");
    let health = relay.health().clone();
    let before = enqueue_n(&db, 10, 10, "u1").await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&db, 1).await == 10
        })
        .await,
        "the first 10 are sent"
    );

    let stopped = tokio::task::spawn_blocking(|| {
        outboxkit_testkit::faults::PgStopped::try_stop().expect("stop PostgreSQL")
    })
    .await
    .expect("stop");
    let says_why = eventually(Duration::from_secs(30), || async {
        health
            .report()
            .reasons
            .iter()
            .any(|r| r.starts_with("the replication slot cannot be read for"))
    })
    .await;
    let report = health.report();
    tokio::task::spawn_blocking(move || drop(stopped))
        .await
        .expect("start PostgreSQL again");
    assert!(says_why, "/healthz says why: {report:?}");
    assert!(
        !report
            .reasons
            .iter()
            .any(|r| r.starts_with("relay stopped")),
        "a restart does not stop the relay: {report:?}"
    );

    // (A producer of its own: the test's pool lost its connections in the restart.)
    let producer = PgOutbox::connect(
        &outboxkit_postgres::PgConfig::new(common::database_url()).with_schema(db.schema()),
    )
    .await
    .expect("connect after the restart");
    let after = enqueue_n(&producer, 10, 10, "u2").await;
    assert!(
        eventually(Duration::from_secs(60), || async {
            count(&producer, 1).await == 20
                && missing(&counts, &before) + missing(&counts, &after) == 0
        })
        .await,
        "the relay resumes: {:?}",
        health.report()
    );
    assert!(
        eventually(Duration::from_secs(30), || async {
            health.report().is_healthy()
        })
        .await,
        "healthy again: {:?}",
        health.report()
    );
    stop.cancel();
    relay.wait().await.expect("a clean stop");
    fx.delete_exchange().await;
}

/// The sum of every series of metric `name` in the relay's `/metrics`.
async fn metric(addr: SocketAddr, name: &str) -> f64 {
    let (_, body) = common::http_get(addr, "/metrics").await;
    body.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// The resident set of process `pid`, in KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("/proc status")
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}

/// Rows parked, counted through the index of pending rows.
async fn parked_rows(db: &PgOutbox) -> i64 {
    scalar(
        db,
        "SELECT count(*) FROM {s}.outbox_messages WHERE phase = 0 AND status = 9",
    )
    .await
}

fn delayed(aggregate: &str, delay: Duration) -> outboxkit_core::NewMessage {
    outboxkit_core::NewMessage::builder("order", aggregate, "OrderPlaced")
        .payload_json("{}")
        .deliver_after(delay)
        .build()
        .expect("valid")
}

/// As a new user would: 10,001 messages delayed an hour, then one delayed 2 s, through
/// `outbox relay --source wal`: the 2 s one is `Sent` within 10 s of coming due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v_a_message_due_in_2s_is_sent_past_10001_parked_for_an_hour() {
    // Shared: a slot test of this binary stopping PostgreSQL meanwhile ended the
    // enqueue of the 10,001 rows (57P01) in CI.
    let _lock = outboxkit_testkit::faults::lock_shared().await;
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    // (A consumer keeps the queue from expiring while the relay parks.)
    let _received = fx.counter().await;
    let relay = start(&db, &relay_args(&fx, &amqp_url()));
    let later: Vec<_> = (0..10_001)
        .map(|i| delayed(&format!("r-later-{i}"), Duration::from_secs(3600)))
        .collect();
    for chunk in later.chunks(1_000) {
        enqueue(&db, chunk).await;
    }
    wait_until(
        &relay,
        Duration::from_secs(90),
        "the 10,001 are parked",
        || async { parked_rows(&db).await == 10_001 },
    )
    .await;
    let soon = delayed("r-soon", Duration::from_secs(2));
    let id = soon.id;
    enqueue(&db, &[soon]).await;
    let sent_after_due = || async {
        sqlx::query_scalar::<_, Option<f64>>(AssertSqlSafe(format!(
            "SELECT extract(epoch FROM sent_at - visible_at)::float8 FROM {}.outbox_messages WHERE id = $1",
            db.schema()
        )))
        .bind(id)
        .fetch_one(db.pool())
        .await
        .expect("row")
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let late = loop {
        if let Some(late) = sent_after_due().await {
            break Some(late);
        }
        if std::time::Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        late.is_some_and(|s| (0.0..10.0).contains(&s)),
        "the message delayed 2 s is sent within 10 s of coming due, not before: {late:?} s after; log:\n{}",
        relay.log()
    );
    relay.terminate();
    let mut relay = relay;
    assert!(relay.exited_within(Duration::from_secs(15)).await.is_some());
    fx.delete_exchange().await;
}

/// `outbox relay --source wal` with its wall clock `offset` seconds ("-1", "+1") off
/// the database's (libfaketime; the monotonic clock left alone), or as it is (`None`);
/// the park log in the debug log. `None` when libfaketime is not installed.
fn start_skewed(db: &PgOutbox, args: &[String], offset: Option<&str>) -> Option<RelayProcess> {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let Some(offset) = offset else {
        return Some(RelayProcess::start(db, &args));
    };
    let env = outboxkit_testkit::faults::skewed_clock_env(offset).ok()?;
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    Some(RelayProcess::start_with_env(db, &args, &env))
}

fn skipped_without_faketime() {
    eprintln!(
        "SKIPPED: libfaketime is not installed (apt-get install -y faketime): the relay's clock cannot be skewed"
    );
}

/// One run of `relay_clock_behind`: 200 messages, one per transaction every 20 ms,
/// through a relay whose clock is `offset` off; returns their ids and the p99 of
/// commit (`created_at`) to `sent_at`, in milliseconds (both by the database's clock).
async fn commit_to_sent_p99(
    db: &PgOutbox,
    fx: &Fixture,
    offset: Option<&str>,
    tag: &str,
) -> Option<(Vec<uuid::Uuid>, f64)> {
    let mut relay = start_skewed(db, &relay_args(fx, &amqp_url()), offset)?;
    // Past the session's careful start.
    let warm = enqueue_n(db, 20, 1, &format!("{tag}-warm")).await;
    wait_until(&relay, Duration::from_secs(30), "warmed up", || async {
        scalar(
            db,
            &format!(
                "SELECT count(*) FROM {{s}}.outbox_messages WHERE status = 1 AND aggregate_id LIKE '{tag}-warm-%'"
            ),
        )
        .await
            == 20
    })
    .await;
    assert_eq!(warm.len(), 20);
    let mut ids = Vec::new();
    for i in 0..200 {
        let m = message("OrderPlaced", "t", &format!("{tag}-{i}"));
        ids.push(m.id);
        enqueue(db, &[m]).await;
        // The load's shape (50 msg/s), not a wait for a result.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let sent = |ids: Vec<uuid::Uuid>| async move {
        sqlx::query_scalar::<_, i64>(AssertSqlSafe(format!(
            "SELECT count(*) FROM {}.outbox_messages WHERE id = ANY($1) AND status = 1",
            db.schema()
        )))
        .bind(ids)
        .fetch_one(db.pool())
        .await
        .expect("count")
            == 200
    };
    wait_until(&relay, Duration::from_secs(60), "all 200 sent", || {
        sent(ids.clone())
    })
    .await;
    let p99: f64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM sent_at - created_at) * 1000)
           FROM {}.outbox_messages WHERE id = ANY($1)",
        db.schema()
    )))
    .bind(&ids)
    .fetch_one(db.pool())
    .await
    .expect("p99");
    relay.terminate();
    assert!(relay.exited_within(Duration::from_secs(15)).await.is_some());
    Some((ids, p99))
}

/// The relay's clock 1 s behind the database's (libfaketime): ordinary messages
/// (`visible_at` = their commit) are not parked, and commit-to-`sent_at` p99 stays
/// within 2x of the same run with the clocks agreeing. (Before, every message looked
/// delayed by a second and went the sweeper's way.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn w_a_relay_clock_behind_the_database_parks_no_ordinary_message() {
    if outboxkit_testkit::faults::libfaketime().is_none() {
        return skipped_without_faketime();
    }
    // A latency comparison: no server restarted by another test meanwhile.
    let _lock = outboxkit_testkit::faults::lock_shared().await;
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let log = ParkLog::install(db.pool(), db.schema()).await;
    let (_, agreeing) = commit_to_sent_p99(&db, &fx, None, "s-same")
        .await
        .expect("a relay");
    let (ids, behind) = commit_to_sent_p99(&db, &fx, Some("-1"), "s-behind")
        .await
        .expect("libfaketime");
    eprintln!(
        "commit to sent_at p99: {agreeing:.1} ms with the clocks agreeing, {behind:.1} ms with the relay's 1 s behind"
    );
    assert_eq!(
        log.parked(&ids).await,
        0,
        "ordinary messages parked by a relay whose clock is 1 s behind"
    );
    assert!(
        behind <= 2.0 * agreeing,
        "commit to sent_at p99 {behind:.1} ms with the relay's clock 1 s behind, {agreeing:.1} ms without"
    );
    fx.delete_exchange().await;
}

/// The relay's clock 1 s ahead of the database's (libfaketime): messages delayed 100 to
/// 900 ms are received no earlier than their `visible_at` by the database's clock (the
/// test's host is the database's). (Before, the relay judged them due by its own
/// clock and published them at once.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_a_relay_clock_ahead_publishes_no_delayed_message_early() {
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let received: Arc<Mutex<std::collections::HashMap<String, chrono::DateTime<chrono::Utc>>>> =
        Arc::default();
    let sink = Arc::clone(&received);
    fx.consume(move |id, _| {
        sink.lock()
            .expect("lock")
            .entry(id)
            .or_insert_with(chrono::Utc::now);
    })
    .await;
    let Some(relay) = start_skewed(&db, &relay_args(&fx, &amqp_url()), Some("+1")) else {
        return skipped_without_faketime();
    };
    let mut ids = Vec::new();
    for i in 0..40_u64 {
        let m = delayed(
            &format!("t-{i}"),
            Duration::from_millis(100 + (i % 9) * 100),
        );
        ids.push(m.id.to_string());
        enqueue(&db, &[m]).await;
        // The load's shape, not a wait for a result.
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    wait_until(
        &relay,
        Duration::from_secs(60),
        "all 40 are received",
        || async {
            ids.iter()
                .all(|id| received.lock().expect("lock").contains_key(id))
        },
    )
    .await;
    let visible: Vec<(String, chrono::DateTime<chrono::Utc>)> =
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id::text, visible_at FROM {}.outbox_messages",
            db.schema()
        )))
        .fetch_all(db.pool())
        .await
        .expect("rows");
    let received = received.lock().expect("lock").clone();
    let early: Vec<i64> = visible
        .iter()
        .filter_map(|(id, at)| {
            let got = received.get(id)?;
            (got < at).then(|| (*at - *got).num_milliseconds())
        })
        .collect();
    assert!(
        early.is_empty(),
        "{} of 40 delayed messages received before their visible_at (ms early: {early:?}); log:\n{}",
        early.len(),
        relay.log()
    );
    relay.terminate();
    let mut relay = relay;
    assert!(relay.exited_within(Duration::from_secs(15)).await.is_some());
    fx.delete_exchange().await;
}

/// `n` messages, each with a routing key of its own, to one queue that is full
/// (`reject-publish`, bound with `#`): every one refused, then, over 10 s, the open
/// circuits (`outbox_destinations_open`), the refused trials per second
/// (`outbox_deferred_total`) and the relay's resident memory stay bounded. Once a
/// consumer drains the queue, every message is sent within `drain`.
async fn routing_keys_to_one_full_queue(n: usize, drain: Duration) {
    // A measurement: no server restarted by another test meanwhile.
    let _lock = outboxkit_testkit::faults::lock_shared().await;
    let (db, _cleanup) = wal_outbox().await;
    // The relay's exchange and one queue, bound with `#`, full: in place of the
    // fixture's, it expires 30 minutes after its last use, not one (the parking of
    // 100,000 takes minutes without a consumer).
    let fx = relay_fixture(FieldTable::default()).await;
    fx.channel
        .queue_delete(
            fx.queue.as_str().into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await
        .expect("delete the fixture's queue");
    let mut args = outboxkit_testkit::rabbit::reject_when_full(1);
    args.insert(
        "x-expires".into(),
        lapin::types::AMQPValue::LongInt(1_800_000),
    );
    fx.channel
        .queue_declare(
            fx.queue.as_str().into(),
            lapin::options::QueueDeclareOptions::default(),
            args,
        )
        .await
        .expect("declare the queue");
    fx.channel
        .queue_bind(
            fx.queue.as_str().into(),
            fx.exchange.as_str().into(),
            "#".into(),
            lapin::options::QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind the queue");
    fx.publish_raw(b"filler").await;
    let relay = start(&db, &relay_args(&fx, &amqp_url()));
    let addr = relay.addr().await;
    let all: Vec<_> = (0..n)
        .map(|i| {
            outboxkit_core::NewMessage::builder("order", format!("u-{i}"), "OrderPlaced")
                .routing_key(format!("orders.rk-{i}"))
                .payload_json("{}")
                .build()
                .expect("valid")
        })
        .collect();
    for chunk in all.chunks(1_000) {
        enqueue(&db, chunk).await;
    }
    let total = i64::try_from(n).expect("n");
    wait_until(
        &relay,
        Duration::from_secs(60 + 60 * (n as u64 / 10_000)),
        "every message is refused and parked",
        || async { parked_rows(&db).await == total },
    )
    .await;
    let rss_parked = rss_kib(relay.pid());
    let refused_before = metric(addr, "outbox_deferred_total").await;
    let mut most_open = 0.0_f64;
    let window = std::time::Instant::now();
    while window.elapsed() < Duration::from_secs(10) {
        most_open = most_open.max(metric(addr, "outbox_destinations_open").await);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let trials_per_second = (metric(addr, "outbox_deferred_total").await - refused_before)
        / window.elapsed().as_secs_f64();
    let rss_held = rss_kib(relay.pid());
    eprintln!(
        "{n} routing keys to one full queue: at most {most_open} circuits open, {trials_per_second:.1} refused trials/s over 10 s, relay RSS {rss_parked} KiB when all were parked, {rss_held} KiB 10 s later"
    );
    assert!(
        most_open <= 1_000.0,
        "{most_open} circuits open for {n} routing keys"
    );
    assert!(
        trials_per_second <= 15.0,
        "{trials_per_second:.1} refused trials per second"
    );
    assert!(
        rss_held < 128 * 1024,
        "the relay's resident memory: {rss_held} KiB"
    );
    // A consumer empties the queue: every message goes.
    let drained = std::time::Instant::now();
    fx.purge().await;
    let counts = fx.counter().await;
    wait_until(&relay, drain, "every message is sent", || async {
        count(&db, 1).await == total
    })
    .await;
    eprintln!(
        "all {n} sent {:.1} s after the queue was drained; relay RSS {} KiB",
        drained.elapsed().as_secs_f64(),
        rss_kib(relay.pid())
    );
    assert_eq!(count(&db, 3).await, 0, "nothing dead");
    drop(counts);
    relay.terminate();
    let mut relay = relay;
    assert!(relay.exited_within(Duration::from_secs(15)).await.is_some());
    let _ = fx
        .channel
        .queue_delete(
            fx.queue.as_str().into(),
            lapin::options::QueueDeleteOptions::default(),
        )
        .await;
    fx.delete_exchange().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn y_3000_routing_keys_to_one_full_queue_keep_circuits_and_trials_bounded() {
    routing_keys_to_one_full_queue(3_000, Duration::from_secs(90)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "at production scale: cargo xtask scale"]
async fn at_scale_100000_routing_keys_to_one_full_queue_keep_circuits_and_trials_bounded() {
    routing_keys_to_one_full_queue(100_000, Duration::from_secs(900)).await;
}
