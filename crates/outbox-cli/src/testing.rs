//! Test-only hooks of the `outbox` binary, compiled only with the crate's `testing`
//! feature (off by default, so a released binary has none of them): each is off unless
//! its environment variable is set. The process tests use them to make the relay fail
//! the way no real broker or row can be made to on demand (`cargo xtask itest` builds
//! the tests with `--features outboxkit-cli/testing`).
//!
//! | variable | effect |
//! |---|---|
//! | `OUTBOX_TESTING_ABORT_ON_EVENT_TYPE` | the relay aborts the process (as an out-of-memory kill or a crash in a driver would end it) whenever it is about to publish a batch holding a message of this event type: the crash-loop guard's test (`tests/relay_restarts.rs`) |

use async_trait::async_trait;
use outboxkit_core::{EventPublisher, OutboxMessage, PublishError, PublishOutcome};

/// The environment variable of the abort hook.
#[cfg(feature = "testing")]
pub const ABORT_ON_EVENT_TYPE: &str = "OUTBOX_TESTING_ABORT_ON_EVENT_TYPE";

/// A publisher with the test hooks around it (none by default).
#[derive(Debug)]
pub struct Hooked<P> {
    inner: P,
    abort_on: Option<String>,
}

impl<P> Hooked<P> {
    /// `inner`, with the hooks the environment asks for (none without the `testing`
    /// feature).
    pub fn from_env(inner: P) -> Self {
        #[cfg(feature = "testing")]
        let abort_on = std::env::var(ABORT_ON_EVENT_TYPE)
            .ok()
            .filter(|t| !t.is_empty());
        #[cfg(not(feature = "testing"))]
        let abort_on = None;
        if let Some(event_type) = &abort_on {
            tracing::warn!(
                event_type,
                "test hook on: the relay aborts on any batch holding this event type"
            );
        }
        Self { inner, abort_on }
    }

    /// The publisher inside.
    pub fn inner(&self) -> &P {
        &self.inner
    }
}

#[async_trait]
impl<P: EventPublisher> EventPublisher for Hooked<P> {
    async fn publish_batch(&self, messages: &[OutboxMessage]) -> Vec<PublishOutcome> {
        if let Some(event_type) = &self.abort_on
            && messages.iter().any(|m| &m.event_type == event_type)
        {
            eprintln!("test hook: a batch holds a {event_type} message: aborting");
            std::process::abort();
        }
        self.inner.publish_batch(messages).await
    }

    fn publish_timeout(&self) -> Option<std::time::Duration> {
        self.inner.publish_timeout()
    }

    async fn check_ready(&self) -> Result<(), PublishError> {
        self.inner.check_ready().await
    }

    fn destination<'a>(&'a self, routing_key: &'a str) -> std::borrow::Cow<'a, str> {
        self.inner.destination(routing_key)
    }
}

/// The binary's internals that this crate's integration tests drive directly (a relay
/// started in the test process, the settings it resolves, the admin connection, the
/// health checks). Not a stable API: the binary's interface is its command line.
pub mod internals {
    pub use crate::cli::{SentRetentionMode, SourceKind};
    pub use crate::commands::dashboard::{DashboardSettings, RunningDashboard, TOKEN_ENV};
    pub use crate::config::{DbSettings, RelaySettings};
    pub use crate::database::connect_admin;
    pub use crate::health::Health;
    pub use crate::relay::Relay;
}
