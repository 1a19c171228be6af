//! Helpers shared by the integration tests: the real NATS server at `NATS_URL` (default
//! `nats://127.0.0.1:4222`) with JetStream, a stream and subject prefix of its own per
//! test (`TEST_<uuid>` capturing `test.<uuid>.>`), raw async-nats access for checking
//! what the stream holds, and PostgreSQL schemas (`t_<uuid>`) for the relay tests.

#![allow(dead_code, unreachable_pub)] // Each test binary uses a different subset.

use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use chrono::{SubsecRound, Utc};
use futures::StreamExt;
use outboxkit_core::{NewMessage, OutboxMessage};
use outboxkit_nats::{NatsConfig, StreamSetup};
use outboxkit_postgres::{PgConfig, PgOutbox};
use tokio::time::Instant;
use uuid::Uuid;

/// How long any condition may take before a test fails.
pub const DEADLINE: Duration = Duration::from_secs(30);

pub fn url() -> String {
    std::env::var("NATS_URL")
        .ok()
        .filter(|u| !u.trim().is_empty())
        .unwrap_or_else(|| outboxkit_nats::config::DEFAULT_URL.to_owned())
}

pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A stream and a subject prefix of its own, deleted by [`Fixture::cleanup`].
pub struct Fixture {
    /// `TEST_<uuid>`.
    pub stream: String,
    /// `test.<uuid>`; the stream captures `test.<uuid>.>`.
    pub prefix: String,
    pub client: async_nats::Client,
    pub js: jetstream::Context,
}

impl Fixture {
    /// A fresh stream (file storage, 2-minute duplicate window) for this test.
    pub async fn new() -> Self {
        Self::with(|setup| setup).await
    }

    /// A fresh stream, its settings adjusted by `adjust`.
    pub async fn with(adjust: impl FnOnce(StreamSetup) -> StreamSetup) -> Self {
        let fixture = Self::unconfigured().await;
        let config = fixture.build();
        adjust(StreamSetup::for_config(&fixture.stream, &config))
            .apply(&config)
            .await
            .expect("create the test stream");
        fixture
    }

    /// Names and a client, but no stream yet.
    pub async fn unconfigured() -> Self {
        let id = Uuid::new_v4().simple().to_string();
        let client = async_nats::connect(url())
            .await
            .expect("connect to NATS (is it running? `cargo xtask services`)");
        let js = jetstream::new(client.clone());
        sweep_old_streams(&js).await;
        Self {
            stream: format!("TEST_{id}"),
            prefix: format!("test.{id}"),
            client,
            js,
        }
    }

    /// Publisher configuration for this fixture's subjects.
    pub fn config(&self) -> NatsConfig {
        NatsConfig::new(url())
            .with_subject_prefix(&self.prefix)
            .with_connection_name(format!("test-{}", self.stream))
    }

    /// [`config`](Self::config), checked valid.
    pub fn build(&self) -> NatsConfig {
        let config = self.config();
        config.validate().expect("valid test configuration");
        config
    }

    /// Messages stored in the stream now.
    pub async fn stored(&self) -> u64 {
        let mut stream = self.js.get_stream(&self.stream).await.expect("get stream");
        stream.info().await.expect("stream info").state.messages
    }

    /// Every message in the stream, in order, read with an ephemeral consumer.
    pub async fn read_all(&self) -> Vec<async_nats::Message> {
        let expected = self.stored().await;
        let stream = self.js.get_stream(&self.stream).await.expect("get stream");
        let consumer = stream
            .create_consumer(consumer::pull::Config {
                ack_policy: consumer::AckPolicy::None,
                ..Default::default()
            })
            .await
            .expect("ephemeral consumer");
        let mut messages = consumer
            .stream()
            .max_messages_per_batch(500)
            .messages()
            .await
            .expect("pull stream");
        let mut out = Vec::new();
        let deadline = Instant::now() + DEADLINE;
        while (out.len() as u64) < expected {
            let message = tokio::time::timeout_at(deadline, messages.next())
                .await
                .expect("every stored message arrives before the deadline")
                .expect("pull stream open")
                .expect("message");
            out.push(message.split().0);
        }
        out
    }

    /// The durable consumer `durable`'s info (pending counts, ack floor).
    pub async fn consumer_info(&self, durable: &str) -> jetstream::consumer::Info {
        let stream = self.js.get_stream(&self.stream).await.expect("stream");
        let consumer: jetstream::consumer::PullConsumer =
            stream.get_consumer(durable).await.expect("consumer");
        consumer.get_info().await.expect("consumer info")
    }

    /// Waits until the durable consumer `durable` has nothing pending or unacknowledged.
    pub async fn nothing_pending(&self, durable: &str) {
        eventually("the consumer has nothing pending", || async {
            let info = self.consumer_info(durable).await;
            info.num_ack_pending == 0 && info.num_pending == 0
        })
        .await;
    }

    pub async fn cleanup(self) {
        let _ = self.js.delete_stream(&self.stream).await;
    }
}

/// Deletes `TEST_*` streams created more than an hour ago (left behind by earlier,
/// failed runs; never by a test still running). Once per test binary.
async fn sweep_old_streams(js: &jetstream::Context) {
    static SWEPT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    SWEPT
        .get_or_init(|| async {
            let mut names = js.stream_names();
            let mut old = Vec::new();
            while let Some(Ok(name)) = names.next().await {
                if !name.starts_with("TEST_") {
                    continue;
                }
                if let Ok(mut s) = js.get_stream(&name).await
                    && let Ok(info) = s.info().await
                    && now_unix() - info.created.unix_timestamp() > 3600
                {
                    old.push(name);
                }
            }
            for name in old {
                let _ = js.delete_stream(&name).await;
            }
        })
        .await;
}

/// An outbox row as a store would hand it to the publisher.
pub fn message(event_type: &str, aggregate_id: &str, payload: &str) -> OutboxMessage {
    let msg = NewMessage::builder("order", aggregate_id, event_type)
        .aggregate_version(1)
        .payload_json(payload)
        .build()
        .expect("test payload is JSON");
    OutboxMessage::claimed_from(msg, Utc::now().trunc_subsecs(6))
}

/// An outbox in a schema of the test's own (see [`fresh_outbox`]), dropped with it.
pub type TestOutbox = outboxkit_testkit::pg::InSchema<PgOutbox>;

/// A fresh, migrated PostgreSQL schema named `t_<uuid>`, dropped when the returned value
/// is (also when the test fails).
pub async fn fresh_outbox() -> TestOutbox {
    let schema = format!("t_{}", Uuid::new_v4().simple());
    let url = database_url();
    let outbox = PgOutbox::connect(
        &PgConfig::new(&url)
            .with_schema(&schema)
            .with_max_connections(6),
    )
    .await
    .expect("connect to PostgreSQL (is it running? `cargo xtask services`)");
    outbox.migrate().await.expect("migrate");
    TestOutbox::new(outbox, &url, &schema)
}

/// `(status code, last_error)` of an outbox row.
pub async fn row_status(outbox: &PgOutbox, id: Uuid) -> (i16, Option<String>) {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT status, last_error FROM {}.outbox_messages WHERE id = $1",
        outbox.schema()
    )))
    .bind(id)
    .fetch_one(outbox.pool())
    .await
    .expect("outbox row")
}

/// Polls `condition` until it holds, failing the test after [`DEADLINE`].
pub async fn eventually<F, Fut>(what: &str, condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    eventually_within(DEADLINE, what, condition).await;
}

/// Polls `condition` until it holds, failing the test after `limit`.
pub async fn eventually_within<F, Fut>(limit: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        if condition().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The first value of header `name` of a raw message.
pub fn header<'a>(message: &'a async_nats::Message, name: &str) -> Option<&'a str> {
    message
        .headers
        .as_ref()?
        .get(name)
        .map(async_nats::HeaderValue::as_str)
}

fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}
