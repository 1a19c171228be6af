//! Connecting to NATS: the client options of a [`NatsConfig`] (name, timeouts, unlimited
//! reconnects by the client itself), a connect bounded by the connect timeout, and the
//! JetStream readiness check.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::timeout;

use crate::config::NatsConfig;
use crate::error::NatsError;

/// How often the client pings the server. The client gives a connection up and
/// reconnects (to another server of a cluster) when more than two pings go unanswered:
/// a server lost without a reset (a host gone, a network partition) is left after
/// about 30 s instead of the 2 minutes of async-nats's default 60 s interval.
pub(crate) const PING_INTERVAL: Duration = Duration::from_secs(10);

impl NatsConfig {
    /// Connect options for a client of this configuration: name, connect timeout, API
    /// request timeout, unlimited reconnects (the default of async-nats, with its backoff
    /// of up to 4 s between attempts), and a [`PING_INTERVAL`] of 10 s.
    pub(crate) fn connect_options(&self) -> async_nats::ConnectOptions {
        async_nats::ConnectOptions::new()
            .name(self.connection_name())
            .connection_timeout(self.connect_timeout())
            .request_timeout(Some(self.connect_timeout()))
            .max_reconnects(None)
            .ping_interval(PING_INTERVAL)
    }

    /// Connects a plain client (no event tracking), failing after the connect timeout.
    /// Validates the configuration first.
    pub(crate) async fn connect_client(&self) -> Result<async_nats::Client, NatsError> {
        self.validate()?;
        connect_with(self, self.connect_options()).await
    }
}

/// Connects with `options`, failing after the connect timeout.
pub(crate) async fn connect_with(
    config: &NatsConfig,
    options: async_nats::ConnectOptions,
) -> Result<async_nats::Client, NatsError> {
    let connecting = options.connect(config.servers()?);
    match tokio::time::timeout(config.connect_budget(), connecting).await {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(source)) => Err(NatsError::Connect {
            url_redacted: config.url_redacted(),
            source: Box::new(source),
        }),
        Err(_) => Err(NatsError::Timeout {
            operation: "connect",
            url_redacted: config.url_redacted(),
            timeout: config.connect_budget(),
        }),
    }
}

/// Asks the JetStream API for the account info (`$JS.API.INFO`) and checks the answer is
/// not an error. `Err` carries a description.
pub(crate) async fn jetstream_ready(
    client: &async_nats::Client,
    limit: Duration,
) -> Result<(), String> {
    let request = client.request("$JS.API.INFO", Bytes::new());
    match timeout(limit, request).await {
        Err(_) => Err(format!("JetStream did not answer within {limit:?}")),
        Ok(Err(e)) => Err(format!("JetStream API request failed: {e}")),
        Ok(Ok(reply)) => match serde_json::from_slice::<serde_json::Value>(&reply.payload) {
            Ok(value) => match value.get("error") {
                None => Ok(()),
                Some(error) => Err(format!("JetStream answered with an error: {error}")),
            },
            Err(e) => Err(format!(
                "JetStream answered something that is not JSON: {e}"
            )),
        },
    }
}
