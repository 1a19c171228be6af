//! `outbox relay` killed and restarted, against the real PostgreSQL and RabbitMQ: the
//! crash-loop guard must take only a row that crashes the relay on its own, never the
//! rows a relay happened to hold when it was killed.
//!
//! - RabbitMQ frozen (`SIGSTOP`) while a relay holds a claimed batch, the relay killed
//!   with `SIGKILL` and started again six times (crash-loop limit 5), each time after
//!   the leases ran out, then RabbitMQ resumed: every row `Sent`, none `Dead`, and each
//!   restarted relay said the broker was unreachable and claimed nothing.
//! - A row that makes the relay abort (the binary's test hook
//!   `OUTBOX_TESTING_ABORT_ON_EVENT_TYPE`), among 19 healthy ones claimed in the same
//!   batch, the relay restarted each time it dies: that row ends `Dead` ("claimed alone
//!   5 times"), its batch-mates `Sent`, each published once.
//!
//! Both hold the machine-wide fault lock of `outboxkit_testkit::faults` (one freezes the
//! shared RabbitMQ).

mod common;

use std::time::Duration;

use common::{RelayProcess, amqp_url, enqueue, fresh_outbox, message, scalar, wait_until};
use lapin::types::FieldTable;
use outboxkit_postgres::PgOutbox;
use outboxkit_rabbit::lapin;
use outboxkit_testkit::faults::{self, RabbitFrozen};
use outboxkit_testkit::rabbit::{Fixture, relay_fixture};

/// Rows by status code.
async fn count(db: &PgOutbox, status: i16) -> i64 {
    scalar(
        db,
        &format!("SELECT count(*) FROM {{s}}.outbox_messages WHERE status = {status}"),
    )
    .await
}

/// Rows a live claim holds (Processing, lease not run out).
async fn held(db: &PgOutbox) -> i64 {
    scalar(
        db,
        "SELECT count(*) FROM {s}.outbox_messages WHERE status = 9 AND lease_until > now()",
    )
    .await
}

/// Messages in the fixture's queue (what RabbitMQ accepted).
async fn queued(fx: &Fixture) -> u32 {
    fx.channel
        .queue_declare(
            fx.queue.as_str().into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("queue")
        .message_count()
}

/// `kill -9` of the relay, then waits for it to be gone.
async fn kill_9(relay: &mut RelayProcess) {
    relay.kill_9();
    assert!(
        relay.exited_within(Duration::from_secs(10)).await.is_some(),
        "the relay is gone"
    );
}

/// The relay's arguments: short timeouts so that leases run out in seconds (a publish
/// takes at most 1 s to connect plus 2 s for confirms; the lease is twice that).
fn args(fx: &Fixture) -> Vec<String> {
    [
        "--transport",
        "rabbit",
        "--broker-url",
        &amqp_url(),
        "--exchange",
        &fx.exchange,
        "--lease",
        "6s",
        "--connect-timeout",
        "1s",
        "--confirm-timeout",
        "2s",
        "--crash-loop-limit",
        "5",
    ]
    .map(str::to_owned)
    .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarts_while_the_broker_is_frozen_dead_letter_nothing() {
    let _lock = faults::lock().await;
    let db = fresh_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let args = args(&fx);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut relay = RelayProcess::start(&db, &args);
    enqueue(&db, &[message("Warmup", "t", "w")]).await;
    wait_until(
        &relay,
        Duration::from_secs(30),
        "the warm-up is sent",
        || async { count(&db, 1).await == 1 },
    )
    .await;

    let frozen = RabbitFrozen::try_freeze().expect("freeze RabbitMQ");
    let rows: Vec<_> = (0..100)
        .map(|i| message("OrderPlaced", "t", &format!("o-{i}")))
        .collect();
    enqueue(&db, &rows).await;
    wait_until(
        &relay,
        Duration::from_secs(10),
        "the relay holds the batch, waiting on the frozen broker",
        || async { held(&db).await == 100 },
    )
    .await;
    kill_9(&mut relay).await;

    for round in 1..=6 {
        // Started again once no lease is live any more: a relay that claims now takes
        // them.
        wait_until(
            &relay,
            Duration::from_secs(20),
            "the leases run out",
            || async { held(&db).await == 0 },
        )
        .await;
        relay = RelayProcess::start(&db, &args);
        wait_until(
            &relay,
            Duration::from_secs(20),
            "the restarted relay finds the broker unreachable",
            || async { relay.log().contains("nothing is claimed until it can") },
        )
        .await;
        assert_eq!(
            held(&db).await,
            0,
            "round {round}: the restarted relay claimed nothing; log:\n{}",
            relay.log()
        );
        kill_9(&mut relay).await;
    }

    drop(frozen);
    relay = RelayProcess::start(&db, &args);
    wait_until(
        &relay,
        Duration::from_secs(60),
        "every row is sent",
        || async { count(&db, 1).await == 101 },
    )
    .await;
    assert_eq!(count(&db, 3).await, 0, "nothing dead");
    let attempts = scalar(&db, "SELECT max(attempts)::bigint FROM {s}.outbox_messages").await;
    assert!(
        attempts <= 2,
        "claimed once before the freeze and once after it, not by each restart: {attempts}"
    );
    assert!(queued(&fx).await >= 101, "every message reached the queue");
    relay.terminate();
    assert!(relay.exited_within(Duration::from_secs(10)).await.is_some());
    fx.delete_exchange().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_that_crashes_the_relay_dies_alone() {
    let _lock = faults::lock().await;
    let db = fresh_outbox().await;
    let fx = relay_fixture(FieldTable::default()).await;
    let args = args(&fx);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut rows: Vec<_> = (0..19)
        .map(|i| message("OrderPlaced", "t", &format!("o-{i}")))
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
        let dead = count(&db, 3).await;
        let sent = count(&db, 1).await;
        if dead == 1 && sent == 19 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "after {starts} starts: {sent} sent, {dead} dead; log:\n{}",
            relay.log()
        );
        if !relay.running() {
            relay = start();
            starts += 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, error): (i16, Option<String>) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT status, last_error FROM {}.outbox_messages WHERE id = $1",
        db.schema()
    )))
    .bind(crash.id)
    .fetch_one(db.pool())
    .await
    .expect("the crashing row");
    assert_eq!(status, 3);
    assert!(
        error
            .as_deref()
            .is_some_and(|e| e.starts_with("suspected crash loop: claimed alone 5 times")),
        "{error:?}"
    );
    assert!(
        starts >= 6,
        "one crash in the batch, five alone: {starts} starts"
    );
    assert_eq!(queued(&fx).await, 19, "each batch-mate published once");
    relay.terminate();
    let _ = relay.exited_within(Duration::from_secs(10)).await;
    fx.delete_exchange().await;
}
