//! The WAL relay's parked rows (`outboxkit_postgres::wal::WalRelay`, feature `wal`) at the
//! sizes production has, against the real PostgreSQL (`wal_level = logical`) and
//! RabbitMQ, the relay in process:
//!
//! - a message delayed 2 s after 10,001 delayed an hour is published within 10 s of
//!   coming due (the sweeper looked at the 10,000 parked rows with the lowest `seq`
//!   and never past them); 1,000,000 delayed an hour in the scale lane;
//! - a destination that refused once (a real queue at `x-max-length` with
//!   `reject-publish`) while 10,001 rows are parked is tried, and takes its messages
//!   once the queue has room;
//! - 10,001 rows parked behind one key's head delayed an hour are no window either;
//! - with 200,000 `Sent` rows retained and one row parked for a day, the relay reads
//!   no whole table while it publishes (the sweeper scanned and sorted the table on
//!   every recorded batch);
//! - a row parked behind a head while the sweeper publishes that head goes after it,
//!   also when the relay dies during that publish;
//! - an operator's destination rule parks 1,000 routing keys of one full queue under
//!   one circuit;
//! - a parked row the sweeper kills (undecodable) does not keep its key waiting;
//! - a parked row due and swept by nobody (the relay gone) counts as a stuck relay for
//!   `/healthz` (`oldest_claimable_wait`).
//!
//! Each test has its own schema, slot, publication and exchange, dropped by guards also
//! on panic.
#![cfg(feature = "wal")]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::database_url;
use common::rabbit::{publisher_to, publisher_with_rules};
use common::wal::{HoldBatch, WalOutbox};
use lapin::types::FieldTable;
use outboxkit_core::{MessageStatus, NewMessage, OutboxAdmin as _, OutboxStore as _};
use outboxkit_postgres::wal::{WalRelayConfig, WalRelayStats};
use outboxkit_postgres::{PgConfig, PgOutbox};
use outboxkit_rabbit::RabbitPublisher;
use outboxkit_testkit::ordered::{Faulty, retry_after};
use outboxkit_testkit::pg::ParkLog;
use outboxkit_testkit::rabbit::{
    DropExchange, Fixture, amqp_url, eventually, reject_when_full, relay_fixture,
};
use sqlx::AssertSqlSafe;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

fn config() -> WalRelayConfig {
    WalRelayConfig::new(database_url()).with_standby_interval(Duration::from_millis(100))
}

/// A message of aggregate `key` with routing key `route`, delayed by `delay`.
fn message(key: &str, route: &str, delay: Duration) -> NewMessage {
    let m = NewMessage::builder("t", key, "Parked")
        .routing_key(route)
        .payload(&serde_json::json!({ "key": key }));
    let m = if delay.is_zero() {
        m
    } else {
        m.deliver_after(delay)
    };
    m.build().expect("message")
}

/// `n` messages, each of its own aggregate, routed to `later`, delayed an hour.
fn an_hour_ahead(n: usize) -> Vec<NewMessage> {
    (0..n)
        .map(|i| message(&format!("later-{i}"), "later", Duration::from_secs(3600)))
        .collect()
}

/// An exchange of the test's (durable, as the relay's) and a queue taking everything
/// (`#`) with `args`. With `consume`, a consumer empties the queue (and keeps it from
/// expiring: it expires after a minute without one).
async fn exchange(args: FieldTable, consume: bool) -> (Fixture, DropExchange) {
    let fx = relay_fixture(args).await;
    let guard = DropExchange::new(&amqp_url(), &fx.exchange);
    if consume {
        fx.consume(|_, _| {}).await;
    }
    (fx, guard)
}

async fn publisher(fx: &Fixture) -> Arc<RabbitPublisher> {
    Arc::new(publisher_to(&fx.exchange).await)
}

async fn scalar(w: &WalOutbox, sql: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(sql.replace("{s}", w.outbox.schema())))
        .fetch_one(w.outbox.pool())
        .await
        .expect("query")
}

async fn status(w: &WalOutbox, id: Uuid) -> MessageStatus {
    w.outbox.get(id).await.expect("get").expect("row").status
}

/// Waits until `n` rows are parked. (Counted through the index of pending rows: a
/// count by status alone would scan the table, see
/// `the_sweeper_scans_no_table_while_a_row_is_parked`.)
async fn parked(w: &WalOutbox, n: i64, limit: Duration) {
    const PARKED: &str = "SELECT count(*) FROM {s}.outbox_messages WHERE phase = 0 AND status = 9";
    let all = eventually(limit, || async { scalar(w, PARKED).await >= n }).await;
    assert!(all, "{n} rows parked: {}", scalar(w, PARKED).await);
}

/// Seconds from `id`'s `visible_at` to its `sent_at` (by the database's clock), once it
/// is `Sent` within `limit`.
async fn sent_after_due(w: &WalOutbox, id: Uuid, limit: Duration) -> Option<f64> {
    let sent = eventually(limit, || async {
        status(w, id).await == MessageStatus::Sent
    })
    .await;
    if !sent {
        return None;
    }
    let secs: f64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT extract(epoch FROM sent_at - visible_at)::float8 FROM {}.outbox_messages WHERE id = $1",
        w.outbox.schema()
    )))
    .bind(id)
    .fetch_one(w.outbox.pool())
    .await
    .expect("sent_at");
    Some(secs)
}

/// 10,001 messages delayed an hour, then one delayed 2 s: published within 10 s of
/// coming due.
async fn a_due_row_past_many_parked_ones_is_published(n: usize, tx: usize) {
    let w = WalOutbox::new().await;
    let (fx, _drop) = exchange(FieldTable::default(), true).await;
    let token = CancellationToken::new();
    let relay = w.spawn(publisher(&fx).await, config(), &token);
    let began = std::time::Instant::now();
    for chunk in an_hour_ahead(n).chunks(tx) {
        common::enqueue_committed(&w.outbox, chunk).await;
    }
    // Every row parked: the slot is confirmed past them (a count would scan them all),
    // then past the relay's own updates that parked them, which come back through the
    // slot (decoded and skipped; docs/wal.md, Not done yet).
    for what in ["parked", "read back its own updates"] {
        let written: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
            .fetch_one(w.outbox.pool())
            .await
            .expect("lsn");
        let confirmed = eventually(Duration::from_secs(120 + n as u64 / 500), || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT confirmed_flush_lsn >= $2::pg_lsn FROM pg_replication_slots WHERE slot_name = $1",
            )
            .bind(w.wal.slot())
            .bind(&written)
            .fetch_one(w.outbox.pool())
            .await
            .expect("slot")
        })
        .await;
        assert!(confirmed, "the relay {what}: the slot is confirmed past it");
    }
    let parking = began.elapsed();
    let soon = message("soon", "soon", Duration::from_secs(2));
    w.enqueue(std::slice::from_ref(&soon)).await;
    let late = sent_after_due(&w, soon.id, Duration::from_secs(15)).await;
    token.cancel();
    let stats = relay.await.expect("join");
    eprintln!(
        "{n} delayed an hour written and parked in {:.1} s; the one delayed 2 s sent {late:?} s after coming due",
        parking.as_secs_f64()
    );
    assert!(
        late.is_some_and(|s| (0.0..10.0).contains(&s)),
        "the message delayed 2 s is sent within 10 s of coming due, not before: {late:?} s after, status {:?}; {stats:?}",
        status(&w, soon.id).await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_due_row_past_10001_parked_ones_is_published() {
    a_due_row_past_many_parked_ones_is_published(10_001, 10_001).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "at production scale: cargo xtask scale"]
async fn at_scale_a_due_row_past_1000000_parked_ones_is_published() {
    // Minutes long: no server restarted by another test meanwhile.
    let _lock = outboxkit_testkit::faults::lock_shared().await;
    a_due_row_past_many_parked_ones_is_published(1_000_000, 10_000).await;
}

/// A queue at its maximum length (`reject-publish`) refuses the first message of
/// `side` while 10,001 rows are parked ahead of it: its circuit opens. Once the queue
/// has room, the circuit's trial finds it, and the message behind it (held by the open
/// circuit) follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_destination_is_tried_past_10001_parked_rows() {
    let w = WalOutbox::new().await;
    let (fx, _drop) = exchange(reject_when_full(2), false).await;
    fx.publish_raw(b"filler").await;
    fx.publish_raw(b"filler").await;
    let token = CancellationToken::new();
    let relay = w.spawn(publisher(&fx).await, config(), &token);
    w.enqueue(&an_hour_ahead(10_001)).await;
    parked(&w, 10_001, Duration::from_secs(60)).await;
    let first = message("side-1", "side", Duration::ZERO);
    w.enqueue(std::slice::from_ref(&first)).await;
    parked(&w, 10_002, Duration::from_secs(30)).await;
    let second = message("side-2", "side", Duration::ZERO);
    w.enqueue(std::slice::from_ref(&second)).await;
    parked(&w, 10_003, Duration::from_secs(30)).await;
    // Room in the queue for both.
    fx.purge().await;
    let both = eventually(Duration::from_secs(20), || async {
        status(&w, first.id).await == MessageStatus::Sent
            && status(&w, second.id).await == MessageStatus::Sent
    })
    .await;
    token.cancel();
    let stats = relay.await.expect("join");
    assert!(
        both,
        "the refusing destination is tried and takes its messages: {:?}, {:?}; {stats:?}",
        status(&w, first.id).await,
        status(&w, second.id).await
    );
    assert_eq!(
        scalar(&w, "SELECT max(attempts)::bigint FROM {s}.outbox_messages").await,
        1,
        "a refusal is not charged"
    );
}

/// An operator's destination rule (`key.#=full-queue`, issue 46 item 6): 1,000 routing
/// keys to one full queue park under one circuit (`parked_for`), tried one trial at a
/// time; once the queue drains, every message goes.
///
/// Before (each routing key its own destination): the parked heads named 1,000
/// circuits, each tried on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_rule_parks_many_routing_keys_under_one_circuit() {
    const N: usize = 1_000;
    let w = WalOutbox::new().await;
    let (fx, _drop) = exchange(reject_when_full(1), false).await;
    fx.publish_raw(b"filler").await;
    let publisher = publisher_with_rules(&fx.exchange, &["key.#=full-queue"]).await;
    let token = CancellationToken::new();
    let relay = w.spawn(Arc::new(publisher), config(), &token);
    let messages: Vec<NewMessage> = (0..N)
        .map(|i| message(&format!("k{i}"), &format!("key.{i}"), Duration::ZERO))
        .collect();
    w.enqueue(&messages).await;
    parked(&w, N as i64, Duration::from_secs(60)).await;
    const CIRCUITS: &str = "SELECT count(DISTINCT parked_for) FROM {s}.outbox_messages \
         WHERE phase = 0 AND status = 9 AND parked_for IS NOT NULL";
    const ITS_OWN: &str = "SELECT count(*) FROM {s}.outbox_messages \
         WHERE phase = 0 AND status = 9 AND parked_for IS DISTINCT FROM 'full-queue'";
    assert_eq!(scalar(&w, CIRCUITS).await, 1, "one circuit");
    assert_eq!(
        scalar(&w, ITS_OWN).await,
        0,
        "every parked row is the rule's"
    );
    fx.consume(|_, _| {}).await; // the queue drains
    let all = eventually(Duration::from_secs(120), || async {
        scalar(
            &w,
            "SELECT count(*) FROM {s}.outbox_messages WHERE status = 1",
        )
        .await
            == N as i64
    })
    .await;
    token.cancel();
    let stats = relay.await.expect("join");
    assert!(all, "every message sent once the queue drains: {stats:?}");
    assert_eq!(stats.dead, 0, "{stats:?}");
}

/// One key's head delayed an hour and 10,001 rows of the key parked behind it, then a
/// message of another key delayed 2 s: published within 10 s of coming due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_behind_a_delayed_head_are_no_window() {
    let w = WalOutbox::new().await;
    let (fx, _drop) = exchange(FieldTable::default(), true).await;
    let token = CancellationToken::new();
    let relay = w.spawn(publisher(&fx).await, config(), &token);
    let mut key = vec![message("k", "later", Duration::from_secs(3600))];
    key.extend((0..10_001).map(|_| message("k", "later", Duration::ZERO)));
    w.enqueue(&key).await;
    parked(&w, 10_002, Duration::from_secs(60)).await;
    let soon = message("soon", "soon", Duration::from_secs(2));
    w.enqueue(std::slice::from_ref(&soon)).await;
    let late = sent_after_due(&w, soon.id, Duration::from_secs(15)).await;
    token.cancel();
    let stats = relay.await.expect("join");
    assert!(
        late.is_some_and(|s| (0.0..10.0).contains(&s)),
        "the message delayed 2 s is sent within 10 s of coming due, not before: {late:?} s after; {stats:?}"
    );
}

/// A relay over a pool of its own (closed with [`Own::close`]): its sessions' table
/// statistics are flushed when they end.
struct Own {
    outbox: PgOutbox,
}

impl Own {
    async fn new(w: &WalOutbox) -> Self {
        let outbox = PgOutbox::connect(
            &PgConfig::new(database_url())
                .with_schema(w.outbox.schema())
                .with_max_connections(4),
        )
        .await
        .expect("connect");
        Self { outbox }
    }

    fn spawn(
        &self,
        w: &WalOutbox,
        publisher: Arc<RabbitPublisher>,
        token: &CancellationToken,
    ) -> JoinHandle<WalRelayStats> {
        let relay = outboxkit_postgres::wal::WalRelay::new(
            self.outbox.clone(),
            w.wal.clone(),
            publisher,
            config(),
        )
        .expect("valid wal relay config");
        let token = token.clone();
        tokio::spawn(async move { relay.run(token).await.expect("the relay runs") })
    }

    async fn close(self) {
        self.outbox.pool().close().await;
    }
}

/// Rows the outbox table's sequential scans have read so far, and the scans of the
/// index of due heads (`outbox_messages_parked_due`: the sweeper's rounds), from the
/// statistics views. The sessions that scanned must have ended (their counters are
/// flushed then).
async fn scans(w: &WalOutbox) -> (i64, i64) {
    let _ = sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(w.outbox.pool())
        .await;
    sqlx::query_as(
        "SELECT COALESCE(t.seq_tup_read, 0),
                (SELECT COALESCE(i.idx_scan, 0) FROM pg_stat_user_indexes AS i
                  WHERE i.schemaname = $1 AND i.indexrelname = 'outbox_messages_parked_due')
           FROM pg_stat_user_tables AS t
          WHERE t.schemaname = $1 AND t.relname = 'outbox_messages'",
    )
    .bind(w.outbox.schema())
    .fetch_one(w.outbox.pool())
    .await
    .expect("statistics")
}

/// 200,000 `Sent` rows retained and one row parked for a day; then 100 messages, each
/// in a transaction of its own (100 batches of the stream): the relay reads no whole
/// table meanwhile (its sessions' sequential scans read fewer rows than the table has),
/// and the sweeper is not woken by each batch (fewer than 10 walks of due heads).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeper_scans_no_table_while_a_row_is_parked() {
    const RETAINED: i64 = 200_000;
    let w = WalOutbox::new().await;
    let (fx, _drop) = exchange(FieldTable::default(), true).await;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO {s}.outbox_messages (id, aggregate_type, aggregate_id, event_type, payload, status, sent_at)
         SELECT gen_random_uuid(), 't', 'old-' || i, 'Old', '{{}}', 1, now() - interval '1 hour'
           FROM generate_series(1, {RETAINED}) AS i;
         ANALYZE {s}.outbox_messages;",
        s = w.outbox.schema()
    )))
    .execute(w.outbox.pool())
    .await
    .expect("retained rows");
    let own = Own::new(&w).await;
    let token = CancellationToken::new();
    let relay = own.spawn(&w, publisher(&fx).await, &token);
    let tomorrow = message("tomorrow", "later", Duration::from_secs(86_400));
    w.enqueue(std::slice::from_ref(&tomorrow)).await;
    parked(&w, 1, Duration::from_secs(30)).await;
    let (read_before, walks_before) = scans(&w).await;
    let now: Vec<NewMessage> = (0..100)
        .map(|i| message(&format!("now-{i}"), "now", Duration::ZERO))
        .collect();
    for m in &now {
        w.enqueue(std::slice::from_ref(m)).await;
    }
    // (By id: a count by status would scan the table itself.)
    let ids: Vec<Uuid> = now.iter().map(|m| m.id).collect();
    let sent = eventually(Duration::from_secs(60), || async {
        let sent: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {}.outbox_messages WHERE id = ANY($1) AND status = 1",
            w.outbox.schema()
        )))
        .bind(&ids)
        .fetch_one(w.outbox.pool())
        .await
        .expect("count");
        sent == 100
    })
    .await;
    token.cancel();
    let stats = relay.await.expect("join");
    own.close().await;
    assert!(sent, "the 100 are sent: {stats:?}");
    let (read, walks) = scans(&w).await;
    let (read, walks) = (read - read_before, walks - walks_before);
    assert!(
        read < RETAINED,
        "sequential scans read {read} rows of the outbox table over 100 batches while a row was parked ({RETAINED} rows in the table)"
    );
    assert!(
        walks < 10,
        "the index of due heads was scanned {walks} times over 100 batches"
    );
}

/// The sweeper publishes key `k`'s head (held in the publish) while the stream parks
/// `k`'s next message behind it: once the head is published, the row behind it goes
/// too. And the same with the relay dying during that publish, a new one started:
/// nothing is stranded behind the head.
async fn behind_a_head_being_published(relay_dies: bool) {
    let w = WalOutbox::new().await;
    let (fx, _drop) = exchange(FieldTable::default(), true).await;
    let head = message("k", "k", Duration::from_secs(2));
    let held = Arc::new(HoldBatch::new(publisher_to(&fx.exchange).await, head.id));
    let first = w.relay(
        Arc::clone(&held),
        config().with_lease(Duration::from_millis(500)),
    );
    let token = CancellationToken::new();
    let first = {
        let token = token.clone();
        tokio::spawn(async move { first.run(token).await })
    };
    w.enqueue(std::slice::from_ref(&head)).await;
    tokio::time::timeout(Duration::from_secs(30), held.held.notified())
        .await
        .expect("the sweeper publishes the head");
    let behind = message("k", "k", Duration::ZERO);
    w.enqueue(std::slice::from_ref(&behind)).await;
    parked(&w, 2, Duration::from_secs(30)).await;
    let running = if relay_dies {
        first.abort();
        let _ = first.await;
        w.spawn(publisher(&fx).await, config(), &token)
    } else {
        held.release.notify_one();
        tokio::spawn(async move { first.await.expect("join").expect("the relay runs") })
    };
    let both = eventually(Duration::from_secs(30), || async {
        status(&w, behind.id).await == MessageStatus::Sent
    })
    .await;
    token.cancel();
    running.await.expect("join");
    assert!(
        both,
        "the row behind the head is sent: head {:?}, behind {:?}",
        status(&w, head.id).await,
        status(&w, behind.id).await
    );
    let sent_at = |id: Uuid| {
        let w = &w;
        async move { w.outbox.get(id).await.expect("get").expect("row").sent_at }
    };
    assert!(
        sent_at(head.id).await <= sent_at(behind.id).await,
        "the head first"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_parked_behind_a_head_being_published_goes_after_it() {
    behind_a_head_being_published(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_dying_while_it_publishes_a_head_strands_nothing_behind_it() {
    behind_a_head_being_published(true).await;
}

/// `k`'s message fails once and is parked; while parked its row is spoiled (headers
/// that do not decode), so the sweeper makes it dead. `k`'s next message then goes
/// straight out: the key no longer waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_row_the_sweeper_kills_leaves_its_key_free() {
    let w = WalOutbox::new().await;
    let (fx, _drop) = exchange(FieldTable::default(), true).await;
    let log = ParkLog::install(w.outbox.pool(), w.outbox.schema()).await;
    let spoiled = message("k", "k", Duration::ZERO);
    let token = CancellationToken::new();
    let relay = w.spawn(
        Arc::new(Faulty::new(publisher(&fx).await, &[(spoiled.id, false, 1)])),
        config().with_retry(retry_after(Duration::from_secs(2), 5)),
        &token,
    );
    w.enqueue(std::slice::from_ref(&spoiled)).await;
    parked(&w, 1, Duration::from_secs(30)).await;
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {}.outbox_messages SET headers = '{{\"retries\": 3}}' WHERE id = $1",
        w.outbox.schema()
    )))
    .bind(spoiled.id)
    .execute(w.outbox.pool())
    .await
    .expect("spoil");
    let dead = eventually(Duration::from_secs(30), || async {
        status(&w, spoiled.id).await == MessageStatus::Dead
    })
    .await;
    assert!(dead, "the spoiled parked row is dead");
    let next = message("k", "k", Duration::ZERO);
    w.enqueue(std::slice::from_ref(&next)).await;
    let sent = eventually(Duration::from_secs(30), || async {
        status(&w, next.id).await == MessageStatus::Sent
    })
    .await;
    token.cancel();
    relay.await.expect("join");
    assert!(sent, "k's next message is sent");
    assert_eq!(
        log.parked(&[next.id]).await,
        0,
        "k's next message was parked behind a row that is dead"
    );
}

/// A row parked until 1 s from now, and no relay to sweep it: once it has been due for
/// a second, the health check's wait (`oldest_claimable_wait`) says so. A relay then
/// publishes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_due_parked_row_nobody_sweeps_is_stuck() {
    let w = WalOutbox::new().await;
    let (fx, _drop) = exchange(FieldTable::default(), true).await;
    let token = CancellationToken::new();
    let relay = w.spawn(publisher(&fx).await, config(), &token);
    let soon = message("soon", "soon", Duration::from_secs(1));
    w.enqueue(std::slice::from_ref(&soon)).await;
    parked(&w, 1, Duration::from_secs(30)).await;
    relay.abort();
    let _ = relay.await;
    let stuck = eventually(Duration::from_secs(30), || async {
        w.outbox
            .oldest_claimable_wait(None)
            .await
            .expect("wait")
            .is_some_and(|d| d >= Duration::from_secs(1))
    })
    .await;
    let row = w.outbox.get(soon.id).await.expect("get").expect("row");
    assert!(
        stuck,
        "a parked row due and unswept counts as waiting: {:?}, status {:?}",
        w.outbox.oldest_claimable_wait(None).await,
        row.status
    );
    let relay = w.spawn(publisher(&fx).await, config(), &token);
    let sent = eventually(Duration::from_secs(30), || async {
        status(&w, soon.id).await == MessageStatus::Sent
    })
    .await;
    token.cancel();
    relay.await.expect("join");
    assert!(sent, "a relay publishes it");
    assert_eq!(
        w.outbox.oldest_claimable_wait(None).await.expect("wait"),
        None
    );
}
