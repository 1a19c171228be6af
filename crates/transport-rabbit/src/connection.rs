//! Connecting to RabbitMQ: a connection named after the configuration (the driver's TCP
//! connect bounded by the connect timeout), confirm-mode channels, and the publisher's
//! session (one connection and its channel slots), dropped when lost and re-established
//! by the next call.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lapin::options::ConfirmSelectOptions;
use lapin::types::LongString;
use lapin::{Channel, Connection, ConnectionProperties};
use tokio::sync::{Mutex, MutexGuard};
use tokio::time::timeout;
use tracing::{info, warn};

use crate::config::Resolved;
use crate::consumer::RabbitConsumer;
use crate::error::RabbitError;
use crate::publisher::RabbitPublisher;
use crate::topology::declare_exchange;

/// One connection and its publisher channels.
#[derive(Debug)]
pub(crate) struct Session {
    pub(crate) connection: Connection,
    /// Confirm-mode channels; `None` until (re)opened. A batch holds its slot's lock for
    /// its whole duration, so confirms of one batch never mix with another's.
    slots: Vec<Mutex<Option<Channel>>>,
    next_slot: AtomicUsize,
}

impl RabbitPublisher {
    /// Runs `fut` under the connect timeout.
    pub(crate) async fn with_connect_timeout<T>(
        &self,
        fut: impl Future<Output = Result<T, RabbitError>>,
    ) -> Result<T, RabbitError> {
        timeout(self.config.connect_timeout(), fut)
            .await
            .unwrap_or_else(|_| {
                Err(RabbitError::ConnectTimeout {
                    url_redacted: self.config.url_redacted().to_owned(),
                    timeout: self.config.connect_timeout(),
                })
            })
    }

    /// The current session, connecting when there is none or it was lost. Concurrent
    /// callers wait for one connection attempt instead of starting their own.
    pub(crate) async fn session(&self) -> Result<Arc<Session>, RabbitError> {
        let mut current = self.session.lock().await;
        if let Some(session) = current.as_ref() {
            if session.connection.status().connected() {
                return Ok(Arc::clone(session));
            }
            warn!(url = %self.config.url_redacted(), "RabbitMQ connection lost, reconnecting");
            *current = None;
        }
        let session = Arc::new(
            self.with_connect_timeout(Session::open(&self.config))
                .await?,
        );
        info!(
            url = %self.config.url_redacted(),
            exchange = %self.config.exchange(),
            channels = self.config.channels(),
            "connected to RabbitMQ"
        );
        *current = Some(Arc::clone(&session));
        Ok(session)
    }

    /// Drops `session` if its connection is gone, so the next call reconnects. A newer
    /// session installed meanwhile by another call is left alone.
    pub(crate) async fn forget_if_lost(&self, session: &Arc<Session>) {
        if session.connection.status().connected() {
            return;
        }
        let mut current = self.session.lock().await;
        if current.as_ref().is_some_and(|s| Arc::ptr_eq(s, session)) {
            *current = None;
        }
    }

    /// A usable confirm channel in `slot`, (re)opening it when needed.
    pub(crate) async fn channel_in(
        &self,
        session: &Session,
        slot: &mut MutexGuard<'_, Option<Channel>>,
    ) -> Result<Channel, RabbitError> {
        if let Some(channel) = slot.as_ref()
            && channel.status().connected()
        {
            return Ok(channel.clone());
        }
        **slot = None;
        let channel = self
            .with_connect_timeout(open_confirm_channel(&session.connection))
            .await;
        if let Err(RabbitError::ConnectTimeout { .. }) = channel {
            // The connection looks open but its node does not answer (frozen, or cut
            // off without a reset): give it up now instead of waiting for the missed
            // heartbeats, so the next call connects, to another node of a cluster.
            warn!(url = %self.config.url_redacted(), "RabbitMQ did not open a channel in time; dropping the connection");
            self.forget(session).await;
        }
        let channel = channel?;
        **slot = Some(channel.clone());
        Ok(channel)
    }

    /// Drops `session` so that the next call reconnects (a newer session installed
    /// meanwhile by another call is left alone), and closes its connection in the
    /// background: a node that does not answer never confirms the close.
    async fn forget(&self, session: &Session) {
        let mut current = self.session.lock().await;
        if current
            .as_ref()
            .is_some_and(|s| std::ptr::eq(Arc::as_ptr(s), session))
            && let Some(dropped) = current.take()
        {
            let limit = self.config.connect_timeout();
            tokio::spawn(async move {
                let _ = timeout(limit, dropped.connection.close(200, "unresponsive".into())).await;
            });
        }
    }
}

impl Session {
    async fn open(config: &Resolved) -> Result<Self, RabbitError> {
        let connection = open_connection(config).await?;
        declare_exchange(&connection, config, !config.declare_exchange()).await?;
        let mut slots = Vec::with_capacity(config.channels());
        for _ in 0..config.channels() {
            slots.push(Mutex::new(Some(open_confirm_channel(&connection).await?)));
        }
        Ok(Self {
            connection,
            slots,
            next_slot: AtomicUsize::new(0),
        })
    }

    /// A free slot if there is one, else the next one in turn (waiting for it).
    pub(crate) async fn take_slot(&self) -> MutexGuard<'_, Option<Channel>> {
        let start = self.next_slot.fetch_add(1, Ordering::Relaxed);
        let n = self.slots.len();
        for k in 0..n {
            if let Ok(guard) = self.slots[(start + k) % n].try_lock() {
                return guard;
            }
        }
        self.slots[start % n].lock().await
    }
}

impl RabbitConsumer {
    pub(crate) async fn connect(&self) -> Result<Connection, RabbitError> {
        self.with_timeout(open_connection(&self.config)).await
    }

    pub(crate) async fn with_timeout<T>(
        &self,
        fut: impl Future<Output = Result<T, RabbitError>>,
    ) -> Result<T, RabbitError> {
        timeout(self.config.connect_timeout(), fut)
            .await
            .unwrap_or_else(|_| {
                Err(RabbitError::ConnectTimeout {
                    url_redacted: self.config.url_redacted().to_owned(),
                    timeout: self.config.connect_timeout(),
                })
            })
    }
}

/// Opens a connection named after the configuration to the first node that accepts
/// one, trying the nodes in turn ([`Resolved::nodes_in_turn`]), each within its
/// share of the connect timeout ([`Resolved::node_connect_timeout`]): a node that
/// refuses, is unreachable or does not answer (frozen, cut off) costs at most that
/// long. Callers bound the whole by the connect timeout; a node tried is remembered,
/// so an attempt cut short goes on with the next node.
///
/// A refusal that is not an outage (bad credentials, an unknown virtual host: a
/// [`Permanent`](outboxkit_core::ErrorKind::Permanent) error) is returned at once: every
/// node of a cluster shares users and virtual hosts.
pub(crate) async fn open_connection(config: &Resolved) -> Result<Connection, RabbitError> {
    let limit = config.node_connect_timeout();
    let mut last = None;
    for (index, node) in config.nodes_in_turn() {
        let mut uri = node.uri.clone();
        if uri.query.connection_timeout.is_none() {
            // Bounds the TCP connect inside the driver too (milliseconds).
            uri.query.connection_timeout =
                Some(u64::try_from(limit.as_millis()).unwrap_or(u64::MAX));
        }
        if uri.query.heartbeat.is_none() {
            uri.query.heartbeat = Some(crate::config::DEFAULT_HEARTBEAT_SECS);
        }
        let properties = ConnectionProperties::default()
            .with_connection_name(LongString::from(config.connection_name()));
        let error = match timeout(limit, Connection::connect_uri(uri, properties)).await {
            Ok(Ok(connection)) => {
                config.tried(index);
                return Ok(connection);
            }
            Ok(Err(source)) => RabbitError::Connect {
                url_redacted: node.url_redacted.clone(),
                source: Box::new(source),
            },
            Err(_) => RabbitError::ConnectTimeout {
                url_redacted: node.url_redacted.clone(),
                timeout: limit,
            },
        };
        config.tried(index);
        if error.kind() == outboxkit_core::ErrorKind::Permanent {
            return Err(error);
        }
        if config.node_count() > 1 {
            warn!(node = %node.url_redacted, error = %error, "RabbitMQ node unavailable, trying the next");
        }
        last = Some(error);
    }
    Err(last.expect("a configuration has at least one node"))
}

/// Opens a channel in confirm mode.
async fn open_confirm_channel(connection: &Connection) -> Result<Channel, RabbitError> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|source| RabbitError::Channel {
            operation: "channel.open",
            source: Box::new(source),
        })?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|source| RabbitError::Channel {
            operation: "confirm.select",
            source: Box::new(source),
        })?;
    Ok(channel)
}

pub(crate) async fn close_connection(connection: &Connection, limit: Duration) {
    if connection.status().connected() {
        let _ = timeout(limit, connection.close(200, "OK".into())).await;
    }
}
