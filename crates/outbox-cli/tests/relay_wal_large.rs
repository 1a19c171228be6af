//! One large producer transaction through `outbox relay --source wal` as its own
//! process, against the real PostgreSQL (`wal_level = logical`) and RabbitMQ:
//!
//! - (a) 50,000 rows of 4 KiB payloads (200 MB) committed in one transaction, parts of
//!   2,000 rows (`OUTBOX_WAL_PART_SIZE`): every row `Sent` and delivered exactly once,
//!   each key's deliveries in commit order, rows updated and deleted later in the same
//!   transaction published as committed (or not at all), and the relay's peak resident
//!   set (`VmHWM`) under 160 MiB (it held the whole transaction, 305 MiB here,
//!   before parts; 161-164 MiB with jemalloc at its default options, 121-127 with
//!   the binary's);
//! - (b) the relay killed (`SIGKILL`) in the middle of a 50,000-row transaction and
//!   started again: the new session reads the transaction again from its start (the
//!   slot is confirmed only at transaction ends) and publishes no row the first one
//!   recorded `Sent`; every row ends `Sent`, delivered at least once;
//! - at scale (`at_scale_a_million_row_transaction_in_bounded_memory`): 1,000,000 rows
//!   in one transaction at the default part size: peak resident set under 256 MiB
//!   (121 MiB here), every row `Sent` and delivered once (again only after a broker
//!   outage, a confirm timed out, which publishes the unconfirmed messages again).
//!
//! Each test has a schema, a slot and a publication of its own, dropped by a guard
//! when it ends, also when it panics.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{
    RelayProcess, TestOutbox, WalCleanup, amqp_url, exec, fresh_outbox, scalar, wait_until,
};
use lapin::types::FieldTable;
use outboxkit_postgres::PgOutbox;
use outboxkit_rabbit::lapin;
use outboxkit_testkit::rabbit::{Fixture, relay_fixture};

async fn wal_outbox() -> (TestOutbox, WalCleanup) {
    let db = fresh_outbox().await;
    let cleanup = WalCleanup::setup(&db);
    (db, cleanup)
}

fn relay_args(fx: &Fixture) -> Vec<String> {
    [
        "--source",
        "wal",
        "--transport",
        "rabbit",
        "--broker-url",
        &amqp_url(),
        "--exchange",
        &fx.exchange,
        // Long: a confirm timed out on a loaded machine is an outage, and the
        // unconfirmed messages go again (duplicates that are not this test's subject).
        "--confirm-timeout",
        "30s",
        "--lease",
        "80s",
        "--health-interval",
        "1s",
    ]
    .map(str::to_owned)
    .to_vec()
}

fn start(db: &PgOutbox, args: &[String], part_size: &str) -> RelayProcess {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    RelayProcess::start_with_env(db, &args, &[("OUTBOX_WAL_PART_SIZE", part_size)])
}

/// Inserts `n` rows in one transaction: ids `…` of ordering key `k{i % keys}`,
/// `aggregate_version` `i`, payload `{"k": key, "v": i, "pad": <pad bytes>}`.
async fn insert_one_transaction(db: &PgOutbox, n: u64, keys: u64, pad: usize) {
    exec(
        db,
        &format!(
            "INSERT INTO {{s}}.outbox_messages
                 (id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, partition_key)
             SELECT gen_random_uuid(), 'order', 'k' || (i % {keys}), i, 'BigTx',
                    json_build_object('k', 'k' || (i % {keys}), 'v', i, 'pad', repeat('x', {pad})),
                    'k' || (i % {keys})
               FROM generate_series(1, {n}) AS i"
        ),
    )
    .await;
}

async fn count(db: &PgOutbox, status: i16) -> i64 {
    scalar(
        db,
        &format!("SELECT count(*) FROM {{s}}.outbox_messages WHERE status = {status}"),
    )
    .await
}

/// The peak resident set of process `pid` (`VmHWM`), in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("/proc status")
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmHWM")
}

/// Every delivery: message id, ordering key, version and whether the payload says
/// `updated`, in the order received.
type Log = Arc<Mutex<Vec<(String, String, i64, bool)>>>;

async fn deliveries(fx: &Fixture) -> Log {
    let log: Log = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&log);
    fx.consume(move |id, body| {
        let v: serde_json::Value = serde_json::from_slice(body).expect("a JSON payload");
        let key = v["k"].as_str().unwrap_or_default().to_owned();
        sink.lock().expect("lock").push((
            id,
            key,
            v["v"].as_i64().unwrap_or(-1),
            v["updated"] == true,
        ));
    })
    .await;
    log
}

/// Deliveries per message id.
fn per_id(log: &Log) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for (id, ..) in log.lock().expect("lock").iter() {
        *counts.entry(id.clone()).or_insert(0) += 1;
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_transaction_is_sent_once_in_bounded_memory() {
    const N: u64 = 50_000;
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let log = deliveries(&fx).await;
    let mut args = relay_args(&fx);
    args.extend(["--ordering", "per-key-skip"].map(str::to_owned));
    let relay = start(&db, &args, "2000");
    relay.addr().await;
    // One transaction: 50,000 rows, then one of them updated (its payload replaced)
    // and one deleted, as an ORM's later statements in the same transaction would.
    exec(
        &db,
        &format!(
            "DO $$ BEGIN
                 INSERT INTO {{s}}.outbox_messages
                     (id, aggregate_type, aggregate_id, aggregate_version, event_type, payload, partition_key)
                 SELECT gen_random_uuid(), 'order', 'k' || (i % 1000), i, 'BigTx',
                        json_build_object('k', 'k' || (i % 1000), 'v', i, 'pad', repeat('x', 4096)),
                        'k' || (i % 1000)
                   FROM generate_series(1, {N}) AS i;
                 UPDATE {{s}}.outbox_messages
                    SET payload = json_build_object('k', 'k7', 'v', 7, 'updated', true)
                  WHERE aggregate_version = 7;
                 DELETE FROM {{s}}.outbox_messages WHERE aggregate_version = 8;
             END $$"
        ),
    )
    .await;
    let expected = i64::try_from(N).expect("small") - 1;
    wait_until(
        &relay,
        Duration::from_secs(120),
        "every row is sent and delivered",
        || async { count(&db, 1).await == expected && per_id(&log).len() as i64 == expected },
    )
    .await;
    let peak_kib = peak_rss_kib(relay.pid());
    eprintln!("relay peak RSS: {} MiB", peak_kib / 1024);
    // Give a duplicate a moment to arrive behind the last delivery.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let log = log.lock().expect("lock").clone();
    assert_eq!(
        log.len() as i64,
        expected,
        "each row delivered exactly once"
    );
    assert!(
        !log.iter().any(|(_, _, v, _)| *v == 8),
        "the row deleted in the transaction is not published"
    );
    assert!(
        log.iter().any(|(_, _, v, updated)| *v == 7 && *updated),
        "the row updated in the transaction is published as committed"
    );
    // Each key's deliveries in commit order.
    let mut last: HashMap<&str, i64> = HashMap::new();
    for (_, key, v, _) in &log {
        let prev = last.insert(key, *v).unwrap_or(0);
        assert!(prev < *v, "key {key}: version {v} delivered after {prev}");
    }
    assert_eq!(count(&db, 3).await, 0, "nothing dead");
    assert!(
        peak_kib < 160 * 1024,
        "the relay's peak resident set is {} MiB for a transaction of 200 MB of payloads",
        peak_kib / 1024
    );
    drop(relay);
    fx.delete_exchange().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b_killed_mid_transaction_publishes_no_sent_row_again() {
    const N: i64 = 50_000;
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let log = deliveries(&fx).await;
    let args = relay_args(&fx);
    let first = start(&db, &args, "1000");
    first.addr().await;
    insert_one_transaction(&db, 50_000, 100, 200).await;
    wait_until(
        &first,
        Duration::from_secs(60),
        "a part of the transaction is sent",
        || async { count(&db, 1).await >= 5_000 },
    )
    .await;
    first.kill_9();
    drop(first);
    // What the first relay recorded: none of it may be published again.
    let sent_before: Vec<String> =
        sqlx::query_scalar::<_, uuid::Uuid>(sqlx::AssertSqlSafe(format!(
            "SELECT id FROM {}.outbox_messages WHERE status = 1",
            db.schema()
        )))
        .fetch_all(db.pool())
        .await
        .expect("sent ids")
        .into_iter()
        .map(|id| id.to_string())
        .collect();
    assert!(
        sent_before.len() < 50_000,
        "killed in the middle of the transaction: {} sent",
        sent_before.len()
    );
    let second = start(&db, &args, "1000");
    wait_until(
        &second,
        Duration::from_secs(120),
        "every row is sent and delivered",
        || async { count(&db, 1).await == N && per_id(&log).len() as i64 == N },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let counts = per_id(&log);
    let again: Vec<&String> = sent_before
        .iter()
        .filter(|id| counts.get(*id).copied().unwrap_or(0) > 1)
        .collect();
    assert!(
        again.is_empty(),
        "{} of the {} rows recorded Sent before the kill were published again (e.g. {:?}); log:\n{}",
        again.len(),
        sent_before.len(),
        again.first(),
        second.log()
    );
    let doubled = counts.values().filter(|&&c| c > 1).count();
    eprintln!(
        "killed with {} sent; delivered again after the restart: {doubled} (in flight at the kill)",
        sent_before.len()
    );
    assert_eq!(count(&db, 3).await, 0, "nothing dead");
    drop(second);
    fx.delete_exchange().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "at production scale: cargo xtask scale"]
async fn at_scale_a_million_row_transaction_in_bounded_memory() {
    const N: i64 = 1_000_000;
    let (db, _cleanup) = wal_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let counts = fx.counter().await;
    let relay = RelayProcess::start(
        &db,
        &relay_args(&fx)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    relay.addr().await;
    let began = std::time::Instant::now();
    insert_one_transaction(&db, 1_000_000, 10_000, 200).await;
    let committed = began.elapsed();
    wait_until(
        &relay,
        Duration::from_secs(1800),
        "every row is sent and delivered",
        || async { count(&db, 1).await == N && counts.lock().expect("lock").len() as i64 == N },
    )
    .await;
    let peak_kib = peak_rss_kib(relay.pid());
    eprintln!(
        "1,000,000 rows in one transaction: committed in {committed:?}, all sent {:?} after the commit; relay peak RSS {} MiB",
        began.elapsed() - committed,
        peak_kib / 1024
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let doubled = counts
        .lock()
        .expect("lock")
        .values()
        .filter(|&&c| c > 1)
        .count();
    // Only a broker outage (a confirm timed out) publishes a message again.
    let outages = relay
        .log()
        .matches("the broker cannot take messages")
        .count();
    assert!(
        doubled == 0 || outages > 0,
        "{doubled} rows delivered twice without an outage"
    );
    eprintln!("delivered twice: {doubled} (after {outages} broker outages)");
    assert_eq!(count(&db, 3).await, 0, "nothing dead");
    assert!(
        peak_kib < 256 * 1024,
        "the relay's peak resident set is {} MiB",
        peak_kib / 1024
    );
    drop(relay);
    fx.delete_exchange().await;
}
