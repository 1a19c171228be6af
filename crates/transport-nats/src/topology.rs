//! [`StreamSetup`]: creates or updates the JetStream stream the publisher writes to.
//!
//! A JetStream publish is only acknowledged when a stream captures its subject, so the
//! stream must exist before the relay runs (a publish on a subject no stream captures
//! is dead-lettered as unroutable, see [`crate::publisher`]).
//!
//! # Durability: what a PubAck promises
//!
//! A PubAck means the stream stored the message: on a single server, written to its
//! file store (or memory, with [`Storage::Memory`]); on a cluster with
//! [`with_replicas(3)`](StreamSetup::with_replicas), stored by a quorum of replicas.
//! It does **not** mean the message is on disk: by default JetStream leaves the data in
//! the operating system's buffers and calls `fsync` every `sync_interval`, 2 minutes by
//! default (NATS docs, [JetStream: syncing data to disk]). So:
//!
//! - a crash or restart of the `nats-server` process loses nothing acknowledged (the
//!   kernel still has the data);
//! - a power loss or kernel crash of a single, unreplicated server can lose messages
//!   acknowledged during the last `sync_interval`, **after** the outbox marked them
//!   `Sent`: the relay will not publish them again. With replicas, a message is lost
//!   only if a quorum of servers loses power at once.
//!
//! Run the server with `jetstream { sync_interval: always }` (an `fsync` before every
//! acknowledgement, at a cost in throughput) when a single server must not lose
//! acknowledged messages on power loss, or use 3 replicas. Memory storage loses
//! everything on a server restart.
//!
//! [JetStream: syncing data to disk]: https://docs.nats.io/nats-concepts/jetstream#syncing-data-to-disk

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use tokio::time::timeout;

use crate::config::{NatsConfig, invalid, subject_problem};
use crate::error::{NatsError, classify_create_stream};

/// What [`StreamSetup::apply`] returns: the stream's configuration and state as the
/// server reports them.
pub type StreamInfo = stream::Info;

/// Default duplicate window: 2 minutes (JetStream's default).
pub const DEFAULT_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// Where a stream keeps its messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Storage {
    /// On disk (the file store). Survives server restarts.
    #[default]
    File,
    /// In memory. Lost when the server stops; faster.
    Memory,
}

/// When a stream may discard messages (JetStream retention policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StreamRetention {
    /// Kept until a limit (age, count, bytes) removes them, whatever consumers did.
    /// Several consumers can each read everything.
    #[default]
    Limits,
    /// Kept while some consumer has not acknowledged them.
    Interest,
    /// Removed once acknowledged by the (single) consumer of each subject: a work queue.
    WorkQueue,
}

/// Settings of one JetStream stream: name, subjects, storage, duplicate window,
/// retention, age and replica count. Setters consume and return the builder;
/// [`apply`](Self::apply) validates and creates or updates the stream.
///
/// ```no_run
/// use std::time::Duration;
/// use outboxkit_nats::{NatsConfig, Storage, StreamRetention, StreamSetup};
///
/// # async fn setup() -> Result<(), outboxkit_nats::NatsError> {
/// let config = NatsConfig::from_env()?
///     .with_subject_prefix("orders.events");
/// let info = StreamSetup::for_config("ORDERS", &config) // subjects: orders.events.>
///     .with_storage(Storage::File)
///     .with_duplicate_window(Duration::from_secs(120))
///     .with_retention(StreamRetention::Limits)
///     .with_max_age(Duration::from_secs(7 * 24 * 3600))
///     .apply(&config)
///     .await?;
/// println!("{} messages in {}", info.state.messages, info.config.name);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct StreamSetup {
    name: String,
    subjects: Vec<String>,
    storage: Storage,
    duplicate_window: Duration,
    retention: StreamRetention,
    max_age: Duration,
    replicas: usize,
}

impl StreamSetup {
    /// A stream named `name` (no whitespace, `.`, `*`, `>`, `/` or `\`), with no
    /// subjects yet, file storage, a 2-minute duplicate window, limits retention, no
    /// age limit and one replica.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            subjects: Vec::new(),
            storage: Storage::File,
            duplicate_window: DEFAULT_DUPLICATE_WINDOW,
            retention: StreamRetention::Limits,
            max_age: Duration::ZERO,
            replicas: 1,
        }
    }

    /// A stream named `name` capturing every subject `config` publishes to
    /// ([`NatsConfig::subject_wildcard`], e.g. `outbox.events.>`).
    pub fn for_config(name: impl Into<String>, config: &NatsConfig) -> Self {
        Self::new(name).with_subject(config.subject_wildcard())
    }

    /// Adds a subject (wildcards allowed: `*` one token, `>` the rest) the stream
    /// captures. Streams' subjects must not overlap.
    pub fn with_subject(mut self, subject: impl Into<String>) -> Self {
        self.subjects.push(subject.into());
        self
    }

    /// Adds several subjects (see [`with_subject`](Self::with_subject)).
    pub fn with_subjects<I, S>(mut self, subjects: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.subjects.extend(subjects.into_iter().map(Into::into));
        self
    }

    /// File (default) or memory storage. Cannot be changed on an existing stream.
    pub fn with_storage(mut self, storage: Storage) -> Self {
        self.storage = storage;
        self
    }

    /// How long the stream remembers `Nats-Msg-Id`s to drop a re-publish (a PubAck with
    /// `duplicate: true`). Default 2 minutes. Keep it above the dispatcher's lease (30 s
    /// by default), so a batch republished after a relay crash is dropped here; longer
    /// windows cost server memory (one id per message of the window). Must not exceed
    /// the max age when one is set.
    pub fn with_duplicate_window(mut self, window: Duration) -> Self {
        self.duplicate_window = window;
        self
    }

    /// The retention policy. Default [`StreamRetention::Limits`]. Cannot be changed on an
    /// existing stream.
    pub fn with_retention(mut self, retention: StreamRetention) -> Self {
        self.retention = retention;
        self
    }

    /// The age after which messages are removed. Default zero: no age limit.
    pub fn with_max_age(mut self, max_age: Duration) -> Self {
        self.max_age = max_age;
        self
    }

    /// Replicas of each message (1 to 5; needs a JetStream cluster above 1). Default 1.
    pub fn with_replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// The stream name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The subjects the stream captures.
    pub fn subjects(&self) -> &[String] {
        &self.subjects
    }

    /// Checks the settings without contacting the server.
    ///
    /// # Errors
    /// [`NatsError::InvalidConfig`] as for [`apply`](Self::apply).
    pub(crate) fn check(&self) -> Result<(), NatsError> {
        self.validate().map(drop)
    }

    fn validate(&self) -> Result<stream::Config, NatsError> {
        if self.name.is_empty()
            || self
                .name
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || ".*>/\\".contains(c))
        {
            return Err(invalid(
                "stream name",
                format!(
                    "{:?} must be non-empty, without whitespace, '.', '*', '>', '/' or '\\'",
                    self.name
                ),
            ));
        }
        if self.subjects.is_empty() {
            return Err(invalid("stream subjects", "at least one subject is needed"));
        }
        for subject in &self.subjects {
            // Wildcards are fine in a stream's subjects; everything else follows the
            // publish rules.
            let probe = subject
                .split('.')
                .map(|t| if t == "*" || t == ">" { "w" } else { t })
                .collect::<Vec<_>>()
                .join(".");
            let misplaced_tail = subject.split('.').rev().skip(1).any(|token| token == ">");
            if let Some(problem) = subject_problem(&probe) {
                return Err(invalid("stream subjects", problem.replace(&probe, subject)));
            }
            if misplaced_tail {
                return Err(invalid(
                    "stream subjects",
                    format!("{subject:?}: '>' must be the last token"),
                ));
            }
        }
        if self.duplicate_window.is_zero() {
            return Err(invalid(
                "duplicate_window",
                "must be greater than zero (deduplication by Nats-Msg-Id is what makes a re-publish harmless)",
            ));
        }
        if !self.max_age.is_zero() && self.duplicate_window > self.max_age {
            return Err(invalid(
                "duplicate_window",
                format!(
                    "{:?} exceeds the max age {:?}",
                    self.duplicate_window, self.max_age
                ),
            ));
        }
        if !(1..=5).contains(&self.replicas) {
            return Err(invalid("replicas", "must be between 1 and 5"));
        }
        Ok(stream::Config {
            name: self.name.clone(),
            subjects: self.subjects.clone(),
            storage: match self.storage {
                Storage::File => stream::StorageType::File,
                Storage::Memory => stream::StorageType::Memory,
            },
            retention: match self.retention {
                StreamRetention::Limits => stream::RetentionPolicy::Limits,
                StreamRetention::Interest => stream::RetentionPolicy::Interest,
                StreamRetention::WorkQueue => stream::RetentionPolicy::WorkQueue,
            },
            duplicate_window: self.duplicate_window,
            max_age: self.max_age,
            num_replicas: self.replicas,
            ..stream::Config::default()
        })
    }

    /// Connects with `config`, creates the stream or updates it to these settings, and
    /// disconnects. Idempotent.
    ///
    /// # Errors
    /// [`NatsError::InvalidConfig`] for invalid settings (nothing is sent), a connection
    /// error as for [`NatsPublisher::connect`](crate::NatsPublisher::connect), or
    /// [`NatsError::Stream`] when the server refuses (subjects overlapping another
    /// stream's, a storage or retention change on an existing stream: permanent) or
    /// JetStream does not answer (unavailable).
    pub async fn apply(&self, config: &NatsConfig) -> Result<StreamInfo, NatsError> {
        let stream_config = self.validate()?;
        let client = config.connect_client().await?;
        let js = jetstream::new(client.clone());
        let result = create_or_update(
            &js,
            stream_config,
            config.connect_timeout(),
            &config.url_redacted(),
        )
        .await;
        let _ = timeout(config.connect_timeout(), client.drain()).await;
        result
    }

    /// Creates the stream or updates it to these settings over an existing JetStream
    /// context, waiting at most `limit` for the server. Idempotent.
    ///
    /// # Errors
    /// As [`apply`](Self::apply), without the connection errors.
    pub async fn apply_with(
        &self,
        js: &jetstream::Context,
        limit: Duration,
    ) -> Result<StreamInfo, NatsError> {
        let stream_config = self.validate()?;
        create_or_update(js, stream_config, limit, "the NATS server").await
    }
}

impl StreamSetup {
    /// The stream over `js`: created with these settings when it does not exist, else
    /// as it is (its settings untouched: the relay or an operator owns them). What a
    /// consumer built [`with_stream_setup`](crate::NatsConsumerConfig::with_stream_setup)
    /// does before creating its durable.
    pub(crate) async fn get_or_create(
        &self,
        js: &jetstream::Context,
        limit: Duration,
    ) -> Result<stream::Stream, NatsError> {
        let config = self.validate()?;
        match timeout(limit, js.get_or_create_stream(config)).await {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(e)) => Err(NatsError::Stream {
                operation: "stream.get_or_create",
                stream: self.name.clone(),
                kind: classify_create_stream(&e),
                source: Box::new(e),
            }),
            Err(_) => Err(NatsError::Timeout {
                operation: "stream.get_or_create",
                url_redacted: "the NATS server".to_owned(),
                timeout: limit,
            }),
        }
    }
}

async fn create_or_update(
    js: &jetstream::Context,
    config: stream::Config,
    limit: Duration,
    url_redacted: &str,
) -> Result<StreamInfo, NatsError> {
    let name = config.name.clone();
    match timeout(limit, js.create_or_update_stream(config)).await {
        Ok(Ok(info)) => Ok(info),
        Ok(Err(e)) => Err(NatsError::Stream {
            operation: "stream.create_or_update",
            stream: name,
            kind: classify_create_stream(&e),
            source: Box::new(e),
        }),
        Err(_) => Err(NatsError::Timeout {
            operation: "stream.create_or_update",
            url_redacted: url_redacted.to_owned(),
            timeout: limit,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(setup: StreamSetup) -> &'static str {
        match setup.validate() {
            Err(NatsError::InvalidConfig { field, .. }) => field,
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }

    #[test]
    fn defaults_map_to_the_stream_config() {
        let config = StreamSetup::new("ORDERS")
            .with_subjects(["orders.>", "billing.*.paid"])
            .validate()
            .expect("valid");
        assert_eq!(config.name, "ORDERS");
        assert_eq!(config.subjects, ["orders.>", "billing.*.paid"]);
        assert_eq!(config.storage, stream::StorageType::File);
        assert_eq!(config.retention, stream::RetentionPolicy::Limits);
        assert_eq!(config.duplicate_window, Duration::from_secs(120));
        assert_eq!(config.max_age, Duration::ZERO);
        assert_eq!(config.num_replicas, 1);
    }

    #[test]
    fn invalid_settings() {
        let base = || StreamSetup::new("S").with_subject("a.>");
        assert_eq!(field(StreamSetup::new("").with_subject("a")), "stream name");
        assert_eq!(
            field(StreamSetup::new("A.B").with_subject("a")),
            "stream name"
        );
        assert_eq!(
            field(StreamSetup::new("A B").with_subject("a")),
            "stream name"
        );
        assert_eq!(field(StreamSetup::new("S")), "stream subjects");
        assert_eq!(
            field(StreamSetup::new("S").with_subject("a..b")),
            "stream subjects"
        );
        assert_eq!(
            field(StreamSetup::new("S").with_subject("a.>.b")),
            "stream subjects"
        );
        assert_eq!(
            field(base().with_duplicate_window(Duration::ZERO)),
            "duplicate_window"
        );
        assert_eq!(
            field(
                base()
                    .with_max_age(Duration::from_secs(60))
                    .with_duplicate_window(Duration::from_secs(120))
            ),
            "duplicate_window"
        );
        assert_eq!(field(base().with_replicas(0)), "replicas");
        assert_eq!(field(base().with_replicas(6)), "replicas");
    }
}
