//! `/healthz`'s queue lag counts a message's age from when it became due, for the
//! polling relay and the WAL relay (`outbox relay` as its own process, against the real
//! PostgreSQL and RabbitMQ):
//!
//! - a message delayed 1 hour is not late before it is due: with `--max-lag 5s` the
//!   relay stays healthy well past 5 s;
//! - a due message that cannot be published (its queue is full: RabbitMQ
//!   `reject-publish`, held back by its destination's circuit or parked) is late, and
//!   turns the relay unhealthy once it has waited longer than `--max-lag`.

mod common;

use std::time::{Duration, Instant};

use common::{RelayProcess, WalCleanup, amqp_url, enqueue, fresh_outbox, http_get, wait_until};
use outboxkit_core::NewMessage;
use outboxkit_postgres::PgOutbox;
use outboxkit_testkit::rabbit::{reject_when_full, relay_fixture};

/// The scenario of the module docs, with the relay started with `source` (empty: the
/// polling relay).
async fn a_delayed_message_is_not_late_but_a_refused_one_is(db: &PgOutbox, source: &[&str]) {
    // A queue of one message, full before the relay starts: it refuses everything.
    let fx = relay_fixture(reject_when_full(1)).await;
    fx.publish_raw(b"filler").await;
    let broker_url = amqp_url();
    let mut args = source.to_vec();
    args.extend([
        "--transport",
        "rabbit",
        "--broker-url",
        &broker_url,
        "--exchange",
        &fx.exchange,
        "--max-lag",
        "5s",
        "--health-interval",
        "1s",
    ]);
    let relay = RelayProcess::start(db, &args);
    let addr = relay.addr().await;
    let healthz = || async { http_get(addr, "/healthz").await };
    wait_until(
        &relay,
        Duration::from_secs(30),
        "the relay is healthy",
        || async { healthz().await.0 == 200 },
    )
    .await;

    let delayed = NewMessage::builder("order", "later", "ReminderDue")
        .payload(&serde_json::json!({ "in": "1h" }))
        .deliver_after(Duration::from_secs(3600))
        .build()
        .expect("valid");
    enqueue(db, &[delayed]).await;
    // Past max_lag (5 s) and several checks (1 s apart): healthy all along.
    let until = Instant::now() + Duration::from_secs(9);
    while Instant::now() < until {
        let (code, body) = healthz().await;
        assert_eq!(
            code,
            200,
            "a message delayed 1 hour is not late: {body}; log:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // A due message the full queue refuses: late once it has waited 5 s.
    let due = common::message("OrderPlaced", "t", "now");
    enqueue(db, &[due]).await;
    let enqueued = Instant::now();
    wait_until(
        &relay,
        Duration::from_secs(30),
        "a refused due message turns the relay unhealthy",
        || async {
            let (code, body) = healthz().await;
            code == 503 && body.contains("queue lag")
        },
    )
    .await;
    assert!(
        enqueued.elapsed() >= Duration::from_secs(5),
        "not before it has waited max_lag"
    );
    let (_, body) = healthz().await;
    let report: serde_json::Value = serde_json::from_str(&body).expect("json");
    let lag = report["oldest_pending_age_secs"].as_f64().expect("a lag");
    assert!(
        lag < 60.0,
        "the lag is the refused message's, not the delayed one's: {body}"
    );
    relay.terminate();
    let mut relay = relay;
    assert!(relay.exited_within(Duration::from_secs(15)).await.is_some());
    fx.delete_exchange().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_relay_lag_counts_from_when_a_message_is_due() {
    let db = fresh_outbox().await;
    a_delayed_message_is_not_late_but_a_refused_one_is(&db, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_relay_lag_counts_from_when_a_message_is_due() {
    let db = fresh_outbox().await;
    let _cleanup = WalCleanup::setup(&db);
    a_delayed_message_is_not_late_but_a_refused_one_is(&db, &["--source", "wal"]).await;
}
