//! The environment variables of the `outbox` binary, read the same way by every
//! store's and transport's `from_env`: one name per setting, one parser per kind of
//! value, one typed error ([`EnvError`]) naming the variable and its (redacted) value.
//!
//! | Variable | Read by | Value | Default |
//! |---|---|---|---|
//! | [`DATABASE_URL`] | every store | the database's URL (its kind must match the store) | required |
//! | [`OUTBOX_SCHEMA`] | every store | `[a-z_][a-z0-9_]{0,62}` | `outbox` |
//! | [`OUTBOX_SENT_RETENTION`] | every store | `keep` or `delete` | `keep` |
//! | [`OUTBOX_CRASH_LOOP_LIMIT`] | every store | claims, at least 1 | 5 |
//! | [`OUTBOX_MAX_PAYLOAD_BYTES`] | every store (not the binary: it never enqueues) | bytes, at least 1 | 1,048,576 |
//! | [`OUTBOX_BROKER_URL`] | every transport | the broker's URL | the local broker |
//! | [`OUTBOX_CONNECT_TIMEOUT`] | every transport | a duration, above zero | 5s |
//! | [`OUTBOX_CONFIRM_TIMEOUT`] | every transport | a duration, above zero | 10s |
//! | [`OUTBOX_EXCHANGE`] | RabbitMQ | an exchange name | `outbox.events` |
//! | [`OUTBOX_DESTINATION_RULES`] | RabbitMQ | `PATTERN=NAME`, comma-separated | none |
//! | [`OUTBOX_SUBJECT_PREFIX`] | NATS | a subject prefix | `outbox.events` |
//! | [`OUTBOX_STREAM`] | NATS | a stream name, declared by the publisher | none |
//!
//! A variable that is unset, or set to blanks only, counts as unset; values are trimmed.
//! Durations take the binary's syntax ([`parse_duration`]): `500ms`, `30s`, `5m`,
//! `1h 30m`, `7d`.
//!
//! Each `from_env` is `from_lookup(|name| std::env::var(name).ok())` inside its crate, so
//! its parsing is tested with a map instead of the process environment:
//!
//! ```
//! use outboxkit_core::env::{Env, EnvError, OUTBOX_CONNECT_TIMEOUT};
//! use std::time::Duration;
//!
//! let env = Env::new(|name: &str| (name == OUTBOX_CONNECT_TIMEOUT).then(|| "1m 30s".to_owned()));
//! assert_eq!(env.duration(OUTBOX_CONNECT_TIMEOUT)?, Some(Duration::from_secs(90)));
//! let env = Env::new(|_: &str| Some("soon".to_owned()));
//! assert!(matches!(
//!     env.duration(OUTBOX_CONNECT_TIMEOUT),
//!     Err(EnvError::Invalid { var: "OUTBOX_CONNECT_TIMEOUT", .. })
//! ));
//! # Ok::<(), EnvError>(())
//! ```

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::database::{DatabaseKind, redact_database_url};
use crate::store::{SentRetention, validate_schema};

/// The database's URL (every store; required).
pub const DATABASE_URL: &str = "DATABASE_URL";
/// The schema (PostgreSQL, SQL Server) or database (MySQL) of the outbox and inbox
/// tables.
pub const OUTBOX_SCHEMA: &str = "OUTBOX_SCHEMA";
/// What completions do with confirmed messages: `keep` or `delete`.
pub const OUTBOX_SENT_RETENTION: &str = "OUTBOX_SENT_RETENTION";
/// Claims alone without an outcome before a row is a suspected crash loop.
pub const OUTBOX_CRASH_LOOP_LIMIT: &str = "OUTBOX_CRASH_LOOP_LIMIT";
/// Longest payload `enqueue` accepts, in bytes of its JSON text.
pub const OUTBOX_MAX_PAYLOAD_BYTES: &str = "OUTBOX_MAX_PAYLOAD_BYTES";
/// The broker's URL (every transport).
pub const OUTBOX_BROKER_URL: &str = "OUTBOX_BROKER_URL";
/// How long connecting to the broker may take.
pub const OUTBOX_CONNECT_TIMEOUT: &str = "OUTBOX_CONNECT_TIMEOUT";
/// How long a batch waits for the broker's confirmations (RabbitMQ publisher confirms,
/// JetStream PubAcks).
pub const OUTBOX_CONFIRM_TIMEOUT: &str = "OUTBOX_CONFIRM_TIMEOUT";
/// RabbitMQ: the exchange published to.
pub const OUTBOX_EXCHANGE: &str = "OUTBOX_EXCHANGE";
/// RabbitMQ: destination rules, `PATTERN=NAME`, comma-separated.
pub const OUTBOX_DESTINATION_RULES: &str = "OUTBOX_DESTINATION_RULES";
/// NATS: the subject prefix.
pub const OUTBOX_SUBJECT_PREFIX: &str = "OUTBOX_SUBJECT_PREFIX";
/// NATS: the JetStream stream the publisher declares, capturing the subject prefix.
pub const OUTBOX_STREAM: &str = "OUTBOX_STREAM";

/// A variable of the environment that is missing or does not parse.
///
/// The value of a URL variable is shown with its password replaced by `***`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EnvError {
    /// A required variable is unset (or blank).
    #[error("{var} is not set")]
    Missing {
        /// The variable, e.g. `"DATABASE_URL"`.
        var: &'static str,
    },
    /// A variable holds a value that is not accepted.
    #[error("{var}={value:?}: {reason}")]
    Invalid {
        /// The variable, e.g. `"OUTBOX_CONNECT_TIMEOUT"`.
        var: &'static str,
        /// Its value (a URL's password replaced by `***`).
        value: String,
        /// What is wrong with it and what is accepted.
        reason: String,
    },
}

impl EnvError {
    /// An [`EnvError::Invalid`]; `value` must already be redacted if it holds a secret.
    pub fn invalid(var: &'static str, value: impl Into<String>, reason: impl fmt::Display) -> Self {
        Self::Invalid {
            var,
            value: value.into(),
            reason: reason.to_string(),
        }
    }

    /// The variable concerned.
    pub fn var(&self) -> &'static str {
        match self {
            Self::Missing { var } | Self::Invalid { var, .. } => var,
        }
    }
}

/// A duration that does not parse (see [`parse_duration`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text:?} is not a duration like 500ms, 30s, 5m or 7d: {reason}")]
pub struct DurationError {
    text: String,
    reason: String,
}

impl DurationError {
    /// What is wrong with the text (the parser's words, without the text).
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

/// Parses a duration such as `500ms`, `30s`, `5m`, `7d`, `1h 30m` (the humantime syntax;
/// surrounding blanks ignored): the one duration syntax of the `outbox` binary, its
/// config file and every `from_env`.
///
/// # Errors
/// [`DurationError`] naming the text.
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    humantime::parse_duration(text.trim()).map_err(|e| DurationError {
        text: text.to_owned(),
        reason: e.to_string(),
    })
}

/// A view of an environment through a lookup function (`name -> value`): the process
/// environment ([`Env::process`]) or, in tests, a map.
pub struct Env<F> {
    lookup: F,
}

impl<F> fmt::Debug for Env<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Env").finish_non_exhaustive()
    }
}

/// The lookup of the process environment.
pub type ProcessLookup = fn(&str) -> Option<String>;

impl Env<ProcessLookup> {
    /// The process environment (`std::env::var`; a value that is not Unicode counts as
    /// unset).
    pub fn process() -> Self {
        Self::new(|name| std::env::var(name).ok())
    }
}

/// The lookup of a fixed set of variables ([`Env::from_pairs`]).
pub type PairsLookup = Box<dyn Fn(&str) -> Option<String> + Send + Sync>;

impl Env<PairsLookup> {
    /// An environment of exactly these `(name, value)` pairs, the process environment
    /// untouched: for tests of settings read through an [`Env`] (the first pair of a
    /// name wins).
    pub fn from_pairs(pairs: &[(&str, &str)]) -> Self {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Self::new(Box::new(move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }))
    }
}

impl<F: Fn(&str) -> Option<String>> Env<F> {
    /// The environment `lookup` answers.
    pub fn new(lookup: F) -> Self {
        Self { lookup }
    }

    /// The trimmed value of `var`; `None` when it is unset or blank.
    pub fn get(&self, var: &str) -> Option<String> {
        (self.lookup)(var)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    }

    /// The value of `var` parsed by `parse`, `None` when unset.
    ///
    /// # Errors
    /// [`EnvError::Invalid`] with `parse`'s error as the reason (the value shown as is:
    /// not for secrets).
    pub fn parse<T, E: fmt::Display>(
        &self,
        var: &'static str,
        parse: impl FnOnce(&str) -> Result<T, E>,
    ) -> Result<Option<T>, EnvError> {
        self.get(var)
            .map(|v| parse(&v).map_err(|e| EnvError::invalid(var, v.clone(), e)))
            .transpose()
    }

    /// [`DATABASE_URL`], which must name an `expected` database (its password hidden
    /// in errors by [`redact_database_url`]).
    ///
    /// # Errors
    /// [`EnvError::Missing`] when unset, [`EnvError::Invalid`] when it names another
    /// database or none.
    pub fn database_url(&self, expected: DatabaseKind) -> Result<String, EnvError> {
        let redact = redact_database_url;
        let url = self
            .get(DATABASE_URL)
            .ok_or(EnvError::Missing { var: DATABASE_URL })?;
        match DatabaseKind::of_url(&url) {
            Some(kind) if kind == expected => Ok(url),
            Some(other) => Err(EnvError::invalid(
                DATABASE_URL,
                redact(&url),
                format!(
                    "names a {other} database; this store is {expected}'s, which takes {}",
                    expected.forms()
                ),
            )),
            None => Err(EnvError::invalid(
                DATABASE_URL,
                redact(&url),
                format!(
                    "names no database this toolkit knows; {expected} takes {}",
                    expected.forms()
                ),
            )),
        }
    }

    /// [`OUTBOX_SCHEMA`], checked to be a plain lower-case identifier.
    ///
    /// # Errors
    /// [`EnvError::Invalid`] for a name the stores refuse.
    pub fn schema(&self) -> Result<Option<String>, EnvError> {
        self.parse(OUTBOX_SCHEMA, |v| match validate_schema(v) {
            Ok(()) => Ok(v.to_owned()),
            Err(crate::OutboxError::Config(reason)) => Err(reason),
            Err(other) => Err(other.to_string()),
        })
    }

    /// [`OUTBOX_SENT_RETENTION`]: `keep` or `delete`.
    ///
    /// # Errors
    /// [`EnvError::Invalid`] for any other value.
    pub fn sent_retention(&self) -> Result<Option<SentRetention>, EnvError> {
        self.parse(OUTBOX_SENT_RETENTION, |v| match v {
            "keep" => Ok(SentRetention::Keep),
            "delete" => Ok(SentRetention::Delete),
            _ => Err("expected keep or delete"),
        })
    }

    /// A count of at least 1 (`u32`, `usize`, ...).
    ///
    /// # Errors
    /// [`EnvError::Invalid`] for anything but a positive integer in `T`'s range.
    pub fn positive<T>(&self, var: &'static str) -> Result<Option<T>, EnvError>
    where
        T: FromStr + PartialEq + From<u8>,
    {
        self.parse(var, |v| match v.parse::<T>() {
            Ok(n) if n != T::from(0) => Ok(n),
            _ => Err("expected a positive integer"),
        })
    }

    /// A duration above zero, in [`parse_duration`]'s syntax.
    ///
    /// # Errors
    /// [`EnvError::Invalid`] for text that is not a duration, or zero.
    pub fn duration(&self, var: &'static str) -> Result<Option<Duration>, EnvError> {
        self.parse(var, |v| match parse_duration(v) {
            Ok(d) if d.is_zero() => Err("must be greater than zero".to_owned()),
            Ok(d) => Ok(d),
            Err(e) => Err(e.to_string()),
        })
    }

    /// A comma-separated list; blank items are dropped, an unset variable is empty.
    pub fn list(&self, var: &str) -> Vec<String> {
        self.get(var)
            .map(|v| {
                v.split(',')
                    .map(str::trim)
                    .filter(|item| !item.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn blanks_are_unset_and_values_trimmed() {
        let e = Env::from_pairs(&[(OUTBOX_SCHEMA, "  "), (OUTBOX_EXCHANGE, " x ")]);
        assert_eq!(e.get(OUTBOX_SCHEMA), None);
        assert_eq!(e.get(OUTBOX_EXCHANGE).as_deref(), Some("x"));
        assert_eq!(e.get("NOT_THERE"), None);
    }

    #[test]
    fn durations_take_the_binary_syntax_and_refuse_zero() {
        let e = Env::from_pairs(&[
            ("A", "500ms"),
            ("B", "1h 30m"),
            ("C", "0s"),
            ("D", "10"),
            ("E", "soon"),
        ]);
        assert_eq!(e.duration("A"), Ok(Some(Duration::from_millis(500))));
        assert_eq!(e.duration("B"), Ok(Some(Duration::from_secs(5400))));
        assert_eq!(e.duration("Z"), Ok(None));
        for var in ["C", "D", "E"] {
            let err = e.duration(var).expect_err(var);
            assert_eq!(err.var(), var);
        }
        assert_eq!(parse_duration(" 7d "), Ok(Duration::from_secs(7 * 86_400)));
        assert!(
            parse_duration("7 fortnights")
                .expect_err("unit")
                .to_string()
                .contains("\"7 fortnights\"")
        );
    }

    #[test]
    fn counts_are_positive() {
        let e = Env::from_pairs(&[("A", "3"), ("B", "0"), ("C", "-1"), ("D", "4294967296")]);
        assert_eq!(e.positive::<u32>("A"), Ok(Some(3)));
        for var in ["B", "C", "D"] {
            assert!(
                matches!(e.positive::<u32>(var), Err(EnvError::Invalid { .. })),
                "{var}"
            );
        }
        assert_eq!(e.positive::<usize>("D"), Ok(Some(4_294_967_296)));
    }

    #[test]
    fn sent_retention_and_schema_are_checked() {
        let e = Env::from_pairs(&[(OUTBOX_SENT_RETENTION, "delete"), (OUTBOX_SCHEMA, "app_1")]);
        assert_eq!(e.sent_retention(), Ok(Some(SentRetention::Delete)));
        assert_eq!(e.schema(), Ok(Some("app_1".to_owned())));
        let e = Env::from_pairs(&[(OUTBOX_SENT_RETENTION, "forever"), (OUTBOX_SCHEMA, "A-b")]);
        let err = e.sent_retention().expect_err("retention");
        assert_eq!(err.var(), OUTBOX_SENT_RETENTION);
        assert!(err.to_string().contains("\"forever\""), "{err}");
        assert_eq!(e.schema().expect_err("schema").var(), OUTBOX_SCHEMA);
    }

    #[test]
    fn the_database_url_must_name_the_stores_database() {
        assert_eq!(
            Env::from_pairs(&[]).database_url(DatabaseKind::Postgres),
            Err(EnvError::Missing { var: DATABASE_URL })
        );
        let e = Env::from_pairs(&[(DATABASE_URL, "mysql://app:s3cret@db/app")]);
        assert!(e.database_url(DatabaseKind::MySql).is_ok());
        let err = e
            .database_url(DatabaseKind::Postgres)
            .expect_err("mysql for postgres");
        let text = err.to_string();
        assert!(
            text.contains("DATABASE_URL") && text.contains("MySQL") && text.contains("postgres://"),
            "{text}"
        );
        assert!(!text.contains("s3cret"), "{text}");
        let err = Env::from_pairs(&[(DATABASE_URL, "oracle://u:s3cret@h/db")])
            .database_url(DatabaseKind::SqlServer)
            .expect_err("unknown");
        assert!(!err.to_string().contains("s3cret"), "{err}");
    }

    #[test]
    fn lists_are_comma_separated() {
        let e = Env::from_pairs(&[("A", "a.#=a, ,b.*=b,")]);
        assert_eq!(e.list("A"), vec!["a.#=a".to_owned(), "b.*=b".to_owned()]);
        assert!(e.list("B").is_empty());
    }
}
