//! Helpers shared by the integration tests: the real RabbitMQ at `AMQP_URL` (default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`), unique names per test, raw lapin access for
//! checking what actually reached the broker, and `rabbitmqctl` for closing a named
//! connection from the server side.

#![allow(dead_code, unreachable_pub)] // Each test binary uses a different subset.

use std::future::Future;
use std::process::Command;
use std::time::Duration;

use chrono::{SubsecRound, Utc};
use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use outboxkit_core::{NewMessage, OutboxMessage};
use outboxkit_rabbit::RabbitConfig;
use tokio::time::Instant;
use uuid::Uuid;

/// How long any condition may take before a test fails.
pub const DEADLINE: Duration = Duration::from_secs(30);

pub fn url() -> String {
    std::env::var("AMQP_URL")
        .ok()
        .filter(|u| !u.trim().is_empty())
        .unwrap_or_else(|| outboxkit_rabbit::config::DEFAULT_URL.to_owned())
}

/// A name unique to this test run, e.g. `test.publish.0190...`.
pub fn unique(prefix: &str) -> String {
    format!("test.{prefix}.{}", Uuid::now_v7())
}

/// Config for the real broker with an exchange of its own.
pub fn config(exchange: &str) -> RabbitConfig {
    RabbitConfig::new(url())
        .with_exchange(exchange)
        .with_connection_name(unique("conn"))
}

/// `config`, checked valid.
pub fn build(config: RabbitConfig) -> RabbitConfig {
    config.validate().expect("valid test configuration");
    config
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

pub async fn raw_connection() -> Connection {
    Connection::connect(&url(), ConnectionProperties::default())
        .await
        .expect("raw lapin connection to the test broker")
}

pub async fn raw_channel(connection: &Connection) -> Channel {
    connection.create_channel().await.expect("raw channel")
}

/// Declares `exchange` exactly as the publisher does (durable topic).
pub async fn declare_exchange(channel: &Channel, exchange: &str, kind: ExchangeKind) {
    channel
        .exchange_declare(
            exchange.into(),
            kind,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("exchange.declare");
}

/// Queue arguments that make a leaked test queue disappear after two idle minutes.
pub fn expiring(mut arguments: FieldTable) -> FieldTable {
    arguments.insert("x-expires".into(), AMQPValue::LongInt(120_000));
    arguments
}

/// Declares a durable, expiring `queue` and binds it to `exchange` with `key`.
pub async fn bind_queue(channel: &Channel, exchange: &str, queue: &str, key: &str) {
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::durable(),
            expiring(FieldTable::default()),
        )
        .await
        .expect("queue.declare");
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("queue.bind");
}

/// Ready messages in `queue` (passive declare).
pub async fn queue_len(channel: &Channel, queue: &str) -> u32 {
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::durable().passive(),
            FieldTable::default(),
        )
        .await
        .expect("passive queue.declare")
        .message_count()
}

pub async fn cleanup(channel: &Channel, exchanges: &[&str], queues: &[&str]) {
    for queue in queues {
        let _ = channel
            .queue_delete((*queue).into(), QueueDeleteOptions::default())
            .await;
    }
    for exchange in exchanges {
        let _ = channel
            .exchange_delete((*exchange).into(), ExchangeDeleteOptions::default())
            .await;
    }
}

/// Polls `condition` until it holds, failing the test after [`DEADLINE`].
pub async fn eventually<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + DEADLINE;
    loop {
        if condition().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {DEADLINE:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn rabbitmqctl(args: &[&str]) -> String {
    let output = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("rabbitmqctl must be installed to force-close connections");
    assert!(
        output.status.success(),
        "rabbitmqctl {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Erlang pids of the broker's connections whose `connection_name` is `name`.
pub fn connection_pids(name: &str) -> Vec<String> {
    let quoted = format!("\"{name}\"");
    rabbitmqctl(&[
        "list_connections",
        "-q",
        "--no-table-headers",
        "pid",
        "client_properties",
    ])
    .lines()
    .filter(|line| line.contains(&quoted))
    .filter_map(|line| line.split_whitespace().next().map(str::to_owned))
    .collect()
}

/// Waits until the broker lists a connection named `name`, then closes every one of
/// them from the server side (AMQP `connection.close` 320 CONNECTION_FORCED), touching
/// no other test's connection. Returns how many were closed.
pub async fn force_close_connections(name: &str) -> usize {
    let name_owned = name.to_owned();
    let deadline = Instant::now() + DEADLINE;
    loop {
        let lookup = name_owned.clone();
        let pids = tokio::task::spawn_blocking(move || connection_pids(&lookup))
            .await
            .expect("rabbitmqctl task");
        if !pids.is_empty() {
            let count = pids.len();
            tokio::task::spawn_blocking(move || {
                for pid in pids {
                    rabbitmqctl(&["close_connection", &pid, "forced by outboxkit-rabbit test"]);
                }
            })
            .await
            .expect("rabbitmqctl task");
            return count;
        }
        assert!(
            Instant::now() < deadline,
            "no broker connection named {name_owned:?} appeared"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Holds its first delivery until told to answer, then acks; acks every later one.
#[derive(Clone, Default)]
pub struct Holding {
    pub seen: std::sync::Arc<std::sync::Mutex<Vec<Uuid>>>,
    pub started: std::sync::Arc<tokio::sync::Notify>,
    pub release: std::sync::Arc<tokio::sync::Notify>,
}

#[async_trait::async_trait]
impl outboxkit_rabbit::DeliveryHandler for Holding {
    async fn handle(
        &self,
        msg: &outboxkit_core::wire::IncomingMessage,
    ) -> outboxkit_rabbit::HandlerDecision {
        let first = {
            let mut seen = self.seen.lock().expect("lock");
            seen.push(msg.id);
            seen.len() == 1
        };
        if first {
            self.started.notify_one();
            self.release.notified().await;
        }
        outboxkit_rabbit::HandlerDecision::Ack
    }
}
