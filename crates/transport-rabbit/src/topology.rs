//! Declaring the topology: the durable topic exchange the publisher publishes to, and the
//! consumer's queue and its bindings.

use std::sync::Arc;

use lapin::options::{
    BasicQosOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection, ExchangeKind};

use crate::config::RabbitConfig;
use crate::connection::{close_connection, open_connection};
use crate::consumer::RabbitConsumer;
use crate::error::RabbitError;
use crate::publisher::RabbitPublisher;

impl RabbitPublisher {
    /// Declares the configured exchange (durable, type `topic`) now, whatever
    /// [`with_declare_exchange`](crate::RabbitConfig::with_declare_exchange)
    /// says. Idempotent.
    ///
    /// # Errors
    /// A connection error as for [`connect`](Self::connect), or
    /// [`RabbitError::Declare`] (e.g. `406 PRECONDITION_FAILED` when an exchange of that
    /// name exists with another type or durability).
    pub async fn declare_exchange(&self) -> Result<(), RabbitError> {
        let current = self
            .session
            .lock()
            .await
            .as_ref()
            .filter(|s| s.connection.status().connected())
            .map(Arc::clone);
        // Without a session, use a connection of its own: opening a session checks the
        // exchange and would fail for the very exchange we are about to declare.
        let declared = self
            .with_connect_timeout(async {
                match &current {
                    Some(session) => {
                        declare_exchange(&session.connection, &self.config, false).await
                    }
                    None => {
                        let connection = open_connection(&self.config).await?;
                        let declared = declare_exchange(&connection, &self.config, false).await;
                        let _ = connection.close(200, "OK".into()).await;
                        declared
                    }
                }
            })
            .await;
        if let Some(session) = &current {
            self.forget_if_lost(session).await;
        }
        declared
    }
}

impl RabbitConsumer {
    /// Connects once, declares the exchange (when configured) and the queue, binds it,
    /// and disconnects. Call it before publishing when messages must not be missed
    /// before [`run`](outboxkit_core::Consumer::run) starts.
    ///
    /// # Errors
    /// A connection, channel or declaration error ([`RabbitError`]).
    pub async fn declare(&self) -> Result<(), RabbitError> {
        let connection = self.connect().await?;
        let result = self.with_timeout(self.setup(&connection)).await;
        close_connection(&connection, self.config.connect_timeout()).await;
        result.map(drop)
    }

    /// Declares and binds on a new channel, sets the prefetch; returns the channel.
    pub(crate) async fn setup(&self, connection: &Connection) -> Result<Channel, RabbitError> {
        if self.config.declare_exchange() {
            declare_exchange(connection, &self.config, false).await?;
        }
        let channel = connection
            .create_channel()
            .await
            .map_err(|source| RabbitError::Channel {
                operation: "channel.open",
                source: Box::new(source),
            })?;
        let queue = ShortString::from(self.queue.as_str());
        if self.declare_queue {
            channel
                .queue_declare(
                    queue.clone(),
                    QueueDeclareOptions {
                        durable: true,
                        ..QueueDeclareOptions::default()
                    },
                    self.queue_arguments.clone(),
                )
                .await
                .map_err(|source| RabbitError::Declare {
                    operation: "queue.declare",
                    name: self.queue.clone(),
                    source: Box::new(source),
                })?;
        }
        for key in &self.binding_keys {
            channel
                .queue_bind(
                    queue.clone(),
                    ShortString::from(self.config.exchange()),
                    ShortString::from(key.as_str()),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|source| RabbitError::Declare {
                    operation: "queue.bind",
                    name: format!("{} -> {} ({key})", self.config.exchange(), self.queue),
                    source: Box::new(source),
                })?;
        }
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await
            .map_err(|source| RabbitError::Channel {
                operation: "basic.qos",
                source: Box::new(source),
            })?;
        Ok(channel)
    }
}

/// Declares the exchange (durable topic) or, when `passive`, checks that it exists, on
/// a short-lived channel (a failed declare closes its channel).
pub(crate) async fn declare_exchange(
    connection: &Connection,
    config: &RabbitConfig,
    passive: bool,
) -> Result<(), RabbitError> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|source| RabbitError::Channel {
            operation: "channel.open",
            source: Box::new(source),
        })?;
    let declared = channel
        .exchange_declare(
            ShortString::from(config.exchange()),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                passive,
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(|source| RabbitError::Declare {
            operation: "exchange.declare",
            name: config.exchange().to_owned(),
            source: Box::new(source),
        });
    if declared.is_ok() {
        // Best effort: the channel is closed on drop anyway.
        let _ = channel.close(200, "OK".into()).await;
    }
    declared
}
