//! One full JetStream stream is one destination circuit of the relay (issue 46 item
//! 6), on the real NATS server and PostgreSQL: the publisher names the stream that
//! refused (`stream NAME`), so 1,000 routing keys captured by one full stream open one
//! circuit, one trial at a time, and another stream's subjects flow meanwhile.
//!
//! Before (each routing key its own destination): the same run opened a circuit per
//! routing key, 1,000 of them (`destination_circuits_opened` 1,000), each tried on its
//! own against the full stream.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::stream::DiscardPolicy;
use common::{Fixture, eventually_within, fresh_outbox};
use outboxkit_core::{
    Dispatcher, DispatcherConfig, EventPublisher, MessageStatus, NewMessage, OutboxProducer,
};
use outboxkit_nats::{NatsPublisher, StreamSetup};
use outboxkit_postgres::PgOutbox;
use tokio_util::sync::CancellationToken;

fn routed(n: usize, prefix: &str) -> Vec<NewMessage> {
    (0..n)
        .map(|i| {
            NewMessage::builder("order", format!("{prefix}{i}"), "OrderPlaced")
                .routing_key(format!("{prefix}.{i}"))
                .payload(&serde_json::json!({ "i": i }))
                .build()
                .expect("valid")
        })
        .collect()
}

async fn enqueue(outbox: &PgOutbox, msgs: &[NewMessage]) {
    let mut tx = outbox.begin().await.expect("begin");
    for chunk in msgs.chunks(1000) {
        outbox.enqueue_batch(&mut tx, chunk).await.expect("enqueue");
    }
    tx.commit().await.expect("commit");
}

async fn count(outbox: &PgOutbox, status: MessageStatus) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}.outbox_messages WHERE status = $1",
        outbox.schema()
    )))
    .bind(status.code())
    .fetch_one(outbox.pool())
    .await
    .expect("count")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_full_stream_is_one_circuit_however_many_subjects_it_captures() {
    const FULL: usize = 1_000;
    const OK: usize = 100;
    // The fixture's stream captures `{prefix}.full.>` and holds one message at most
    // (`discard: new`: the next publish is refused); a second stream takes `ok.>`.
    let fx = Fixture::unconfigured().await;
    let config = fx.build();
    let full_subjects = format!("{}.full.>", fx.prefix);
    StreamSetup::new(&fx.stream)
        .with_subjects([full_subjects.clone()])
        .apply(&config)
        .await
        .expect("full stream");
    let ok_stream = format!("{}_OK", fx.stream);
    StreamSetup::new(&ok_stream)
        .with_subjects([format!("{}.ok.>", fx.prefix)])
        .apply(&config)
        .await
        .expect("ok stream");
    let mut info = fx
        .js
        .get_stream(&fx.stream)
        .await
        .expect("stream")
        .info()
        .await
        .expect("info")
        .config
        .clone();
    info.max_messages = 1;
    info.discard = DiscardPolicy::New;
    fx.js.update_stream(info.clone()).await.expect("limit");
    fx.js
        .publish(format!("{}.full.filler", fx.prefix), "filler".into())
        .await
        .expect("publish")
        .await
        .expect("filler stored");

    let (outbox, _schema) = fresh_outbox().await.into_parts();
    let outbox = Arc::new(outbox);
    enqueue(&outbox, &routed(FULL, "full")).await;
    enqueue(&outbox, &routed(OK, "ok")).await;
    let publisher = Arc::new(NatsPublisher::connect(config).await.expect("publisher"));
    let d = Dispatcher::new(
        Arc::clone(&outbox),
        Arc::clone(&publisher),
        DispatcherConfig::new()
            .with_batch_size(100)
            .with_poll_interval(Duration::from_millis(50))
            .with_probe_backoff(Duration::from_millis(100), Duration::from_millis(500)),
    )
    .expect("valid dispatcher config");
    let token = CancellationToken::new();
    let running = {
        let (d, t) = (d.clone(), token.clone());
        tokio::spawn(async move { d.run(t).await })
    };

    let mut most_open = 0;
    eventually_within(
        Duration::from_secs(60),
        "every message of the full stream held, the other stream's sent",
        || {
            most_open = most_open.max(d.destination_circuits());
            let (outbox, deferred) = (Arc::clone(&outbox), d.stats().deferred);
            async move {
                deferred >= FULL as u64 && count(&outbox, MessageStatus::Sent).await == OK as i64
            }
        },
    )
    .await;
    let stream_name = format!("stream {}", fx.stream);
    assert_eq!(
        publisher.destination(&format!("full.{}", FULL + 7)),
        stream_name,
        "a subject of the refusing stream is known by the stream"
    );
    assert_eq!(
        publisher.destination("ok.1"),
        "ok.1",
        "the other stream's are not"
    );
    // Refused trials go on for a while against the still full stream.
    eventually_within(Duration::from_secs(30), "refused trials", || async {
        d.stats().destination_trials_refused >= 5
    })
    .await;
    most_open = most_open.max(d.destination_circuits());
    let stats = d.stats();
    eprintln!(
        "{FULL} subjects of one full stream: circuits opened {}, most open {most_open}, refused trials {}",
        stats.destination_circuits_opened, stats.destination_trials_refused
    );
    assert_eq!(stats.destination_circuits_opened, 1, "{stats:?}");
    assert_eq!(most_open, 1);
    assert_eq!(
        outboxkit_testkit::pg::held_destinations(outbox.pool(), outbox.schema()).await,
        HashSet::from([stream_name.clone()]),
        "held rows name the stream"
    );

    // The stream takes messages again: one trial closes the circuit and every held
    // row goes, each once.
    info.max_messages = -1;
    fx.js.update_stream(info).await.expect("unlimited");
    eventually_within(
        Duration::from_secs(120),
        "every message sent once the stream takes messages",
        || {
            let outbox = Arc::clone(&outbox);
            async move { count(&outbox, MessageStatus::Sent).await == (FULL + OK) as i64 }
        },
    )
    .await;
    assert_eq!(
        fx.stored().await,
        FULL as u64 + 1,
        "each once, and the filler"
    );
    token.cancel();
    running.await.expect("join").expect("run");
    let _ = fx.js.delete_stream(&ok_stream).await;
    fx.cleanup().await;
}
