//! RabbitMQ fixtures: an isolated exchange and queue per test, and a raw lapin consumer
//! that records which message ids arrived and how often.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, ExchangeDeclareOptions,
    QueueBindOptions, QueueDeclareOptions, QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};

/// `AMQP_URL`, or the local RabbitMQ (`amqp://guest:guest@127.0.0.1:5672/%2f`).
pub fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// An isolated exchange (and queue) on the real RabbitMQ, with an open connection.
pub struct Fixture {
    /// The topic exchange `t.<uuid>` (auto-deleted when unused).
    pub exchange: String,
    /// The queue `t.<uuid>.q`, bound to `#` when the fixture was made with `bind`.
    pub queue: String,
    /// The fixture's connection.
    pub conn: Connection,
    /// A channel on it.
    pub channel: Channel,
}

/// A topic exchange `t.<uuid>` as the relay declares it (durable, not auto-deleted), and
/// a queue bound to `#` with `queue_args` (expiring a minute after its last use). Delete
/// the exchange with [`Fixture::delete_exchange`] at the end of the test.
pub async fn relay_fixture(queue_args: FieldTable) -> Fixture {
    declare(true, queue_args, true).await
}

/// A topic exchange `t.<uuid>` (auto-deleted once no queue is bound to it); with `bind`,
/// a queue bound to `#` with `queue_args`.
pub async fn fixture(bind: bool, queue_args: FieldTable) -> Fixture {
    declare(bind, queue_args, false).await
}

async fn declare(bind: bool, mut queue_args: FieldTable, durable: bool) -> Fixture {
    // auto_delete needs a consumer to have come and gone; a queue never consumed (the
    // nack tests) would stay. Expire it a minute after it was last used instead.
    queue_args.insert("x-expires".into(), AMQPValue::LongInt(60_000));
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let exchange = format!("t.{tag}");
    let queue = format!("t.{tag}.q");
    let conn = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .expect("connect to RabbitMQ (is it running? `cargo xtask services`)");
    let channel = conn.create_channel().await.expect("channel");
    channel
        .exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                auto_delete: !durable,
                durable,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("exchange");
    if bind {
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    auto_delete: true,
                    ..Default::default()
                },
                queue_args,
            )
            .await
            .expect("queue");
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                "#".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind");
    }
    Fixture {
        exchange,
        queue,
        conn,
        channel,
    }
}

/// Deletes a test's exchange at `amqp_url` when it goes out of scope, also when the test
/// panics, on a connection and a runtime of its own (a guard's `Drop` may run on the
/// test's runtime). Best effort: a failure is said past the test capture. (Queues declared with `x-expires`
/// go by themselves; exchanges do not.)
#[derive(Debug)]
pub struct DropExchange {
    amqp_url: String,
    exchange: String,
}

impl DropExchange {
    /// A guard for `exchange`.
    pub fn new(amqp_url: &str, exchange: &str) -> Self {
        Self {
            amqp_url: amqp_url.to_owned(),
            exchange: exchange.to_owned(),
        }
    }
}

impl Drop for DropExchange {
    fn drop(&mut self) {
        let (url, exchange) = (self.amqp_url.clone(), self.exchange.clone());
        let done = crate::on_own_runtime(async move {
            let conn = Connection::connect(&url, ConnectionProperties::default())
                .await
                .expect("connect to RabbitMQ");
            let channel = conn.create_channel().await.expect("channel");
            channel
                .exchange_delete(
                    exchange.as_str().into(),
                    lapin::options::ExchangeDeleteOptions::default(),
                )
                .await
                .expect("delete the exchange");
            let _ = conn.close(200, "".into()).await;
        });
        if !done {
            crate::leftover(&format!(
                "cleanup of exchange {} failed: delete it by hand",
                self.exchange
            ));
        }
    }
}

/// Queue arguments that make the broker nack publishes once `max_len` messages wait.
pub fn reject_when_full(max_len: i64) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(max_len));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    args
}

impl Fixture {
    /// Publishes one filler message straight to the queue (through the exchange).
    pub async fn publish_raw(&self, body: &[u8]) {
        self.channel
            .basic_publish(
                self.exchange.as_str().into(),
                "filler".into(),
                BasicPublishOptions::default(),
                body,
                BasicProperties::default(),
            )
            .await
            .expect("publish");
    }

    /// Deletes the exchange (best effort).
    pub async fn delete_exchange(&self) {
        let _ = self
            .channel
            .exchange_delete(
                self.exchange.as_str().into(),
                lapin::options::ExchangeDeleteOptions::default(),
            )
            .await;
    }

    /// Empties the queue.
    pub async fn purge(&self) {
        self.channel
            .queue_purge(self.queue.as_str().into(), QueuePurgeOptions::default())
            .await
            .expect("purge");
    }

    /// Starts consuming the queue with acks, handing every delivery's message id (empty
    /// when it has none) and body to `on_delivery`, in the order the broker delivers
    /// them, until the connection closes.
    pub async fn consume(&self, on_delivery: impl FnMut(String, &[u8]) + Send + 'static) {
        self.consume_queue(&self.queue, on_delivery).await;
    }

    /// [`consume`](Self::consume) of another queue, `queue`, on this fixture's
    /// connection.
    pub async fn consume_queue(
        &self,
        queue: &str,
        mut on_delivery: impl FnMut(String, &[u8]) + Send + 'static,
    ) {
        let channel = self.conn.create_channel().await.expect("channel");
        let mut consumer = channel
            .basic_consume(
                queue.into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("consume");
        tokio::spawn(async move {
            let _channel = channel;
            while let Some(Ok(delivery)) = consumer.next().await {
                let id = delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.to_string())
                    .unwrap_or_default();
                on_delivery(id, &delivery.data);
                let _ = delivery.ack(BasicAckOptions::default()).await;
            }
        });
    }

    /// Starts consuming the queue, counting deliveries per message id.
    pub async fn counter(&self) -> Arc<Mutex<HashMap<String, usize>>> {
        self.counter_of(&self.queue).await
    }

    /// [`counter`](Self::counter) of another queue, `queue`.
    pub async fn counter_of(&self, queue: &str) -> Arc<Mutex<HashMap<String, usize>>> {
        let counts = Arc::new(Mutex::new(HashMap::new()));
        let sink = Arc::clone(&counts);
        self.consume_queue(queue, move |id, _| {
            *sink.lock().expect("lock").entry(id).or_insert(0) += 1;
        })
        .await;
        counts
    }
}

/// Polls `f` every 50 ms until it is true or `timeout` passes; returns the last value.
pub async fn eventually<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if f().await {
            return true;
        }
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
