//! Destinations as JetStream names them: the stream that refused a publish, so that
//! one full stream is one circuit of the relay however many subjects it captures
//! ([`EventPublisher::destination`](outboxkit_core::EventPublisher::destination)).
//!
//! A JetStream refusal (stream full with `discard: new`, out of storage, no leader)
//! names no stream in the error the client hands us. So when a publish on a subject is
//! refused, the publisher asks JetStream which stream captures it
//! (`$JS.API.STREAM.NAMES` with a subject filter) and reads that stream's subject
//! filters (`$JS.API.STREAM.INFO`): every subject they match is known by the stream
//! from then on, as `stream NAME`. Subjects no refusing stream captures stay their own
//! destination (their routing key), as everywhere else.
//!
//! Bounds: at most [`MAX_STREAMS`] streams are remembered (the oldest learned goes
//! first), at most [`LOOKUPS_PER_BATCH`] lookups run for one batch's refusals (the
//! other subjects are looked up at their next refusal), and a stream's subjects are
//! looked up again when it refuses after [`RELEARN_AFTER`] (a stream whose subjects
//! changed). What a stale entry costs is bounded: the relay's trials publish a message
//! held for a circuit under that circuit's name, so a circuit always closes when its
//! messages can go.

use std::borrow::Cow;
use std::sync::{PoisonError, RwLock};
use std::time::Duration;

use tokio::time::Instant;

/// Most refusing streams remembered per publisher.
pub(crate) const MAX_STREAMS: usize = 256;
/// Most stream lookups for the refusals of one batch.
pub(crate) const LOOKUPS_PER_BATCH: usize = 4;
/// A stream that refuses again after this long has its subjects looked up again.
pub(crate) const RELEARN_AFTER: Duration = Duration::from_secs(60);

/// The destination name of stream `name`: `stream NAME` (a space cannot occur in a
/// subject token, so no routing key is named so).
pub(crate) fn stream_destination(name: &str) -> String {
    format!("stream {name}")
}

#[derive(Debug)]
struct Refuser {
    destination: String,
    subjects: Vec<String>,
    learned: Instant,
}

impl Refuser {
    /// Whether one of its subject filters matches `subject`.
    fn captures(&self, subject: &str) -> bool {
        self.subjects.iter().any(|f| subject_matches(f, subject))
    }
}

/// The streams that refused publishes, newest first.
#[derive(Debug, Default)]
pub(crate) struct Refusers {
    streams: RwLock<Vec<Refuser>>,
}

impl Refusers {
    /// The destination of `subject`: the newest known refusing stream that captures
    /// it, else `None`.
    pub(crate) fn destination_of(&self, subject: &str) -> Option<String> {
        let streams = self.streams.read().unwrap_or_else(PoisonError::into_inner);
        streams
            .iter()
            .find(|s| s.captures(subject))
            .map(|s| s.destination.clone())
    }

    /// Whether anything is known (the fast path of every message).
    pub(crate) fn is_empty(&self) -> bool {
        self.streams
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_empty()
    }

    /// Whether a refusal on `subject` needs a lookup: no stream known to capture it
    /// was learned within [`RELEARN_AFTER`].
    pub(crate) fn needs_lookup(&self, subject: &str) -> bool {
        let streams = self.streams.read().unwrap_or_else(PoisonError::into_inner);
        !streams
            .iter()
            .any(|s| s.learned.elapsed() < RELEARN_AFTER && s.captures(subject))
    }

    /// Stream `name` captures `subjects` (its filters): it becomes the newest entry.
    pub(crate) fn learned(&self, name: &str, subjects: Vec<String>) {
        let destination = stream_destination(name);
        let mut streams = self.streams.write().unwrap_or_else(PoisonError::into_inner);
        streams.retain(|s| s.destination != destination);
        streams.insert(
            0,
            Refuser {
                destination,
                subjects,
                learned: Instant::now(),
            },
        );
        streams.truncate(MAX_STREAMS);
    }
}

/// Whether the subject filter `filter` matches `subject` (NATS subject-based
/// addressing: tokens split on `.`, `*` matches one token, `>` as the last token
/// matches one or more). <https://docs.nats.io/nats-concepts/subjects#wildcards>
pub(crate) fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut f = filter.split('.');
    let mut s = subject.split('.');
    loop {
        match (f.next(), s.next()) {
            (Some(">"), Some(_)) => return f.next().is_none(),
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// The destination of `routing_key` under `subject_for` with `refusers`: the refusing
/// stream that captures its subject, else the routing key itself.
pub(crate) fn destination<'a>(
    refusers: &Refusers,
    routing_key: &'a str,
    subject_for: impl FnOnce(&str) -> String,
) -> Cow<'a, str> {
    if refusers.is_empty() {
        return Cow::Borrowed(routing_key);
    }
    match refusers.destination_of(&subject_for(routing_key)) {
        Some(d) => Cow::Owned(d),
        None => Cow::Borrowed(routing_key),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_match_as_nats_does() {
        assert!(subject_matches("orders.>", "orders.a"));
        assert!(subject_matches("orders.>", "orders.a.b"));
        assert!(!subject_matches("orders.>", "orders"));
        assert!(subject_matches("orders.*", "orders.a"));
        assert!(!subject_matches("orders.*", "orders.a.b"));
        assert!(subject_matches("*.a", "x.a"));
        assert!(subject_matches("orders.a", "orders.a"));
        assert!(!subject_matches("orders.a", "orders.b"));
        assert!(!subject_matches("orders.a", "orders.a.b"));
        assert!(subject_matches(">", "anything.at.all"));
        assert!(!subject_matches("a.>.b", "a.x.b"), "> only last");
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusing_stream_names_every_subject_it_captures() {
        let r = Refusers::default();
        let subject = |k: &str| format!("ev.{k}");
        assert_eq!(
            destination(&r, "full.1", subject),
            "full.1",
            "nothing known"
        );
        assert!(r.needs_lookup("ev.full.1"));
        r.learned("FULL", vec!["ev.full.>".into()]);
        assert_eq!(destination(&r, "full.1", subject), "stream FULL");
        assert_eq!(destination(&r, "full.2", subject), "stream FULL");
        assert_eq!(destination(&r, "other", subject), "other");
        assert!(!r.needs_lookup("ev.full.7"), "known and fresh");
        tokio::time::advance(RELEARN_AFTER).await;
        assert!(r.needs_lookup("ev.full.7"), "looked up again after a while");
        // The newest entry wins (a subject moved to another stream).
        r.learned("MOVED", vec!["ev.full.1".into()]);
        assert_eq!(destination(&r, "full.1", subject), "stream MOVED");
        assert_eq!(destination(&r, "full.2", subject), "stream FULL");
        for i in 0..MAX_STREAMS + 10 {
            r.learned(&format!("S{i}"), vec![format!("s.{i}")]);
        }
        assert_eq!(
            r.streams.read().expect("lock").len(),
            MAX_STREAMS,
            "bounded"
        );
    }
}
