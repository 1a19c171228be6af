//! The store conformance suite: the properties of [`OutboxStore`] stated once, run by
//! every backend against itself (enable the `conformance` feature in dev-dependencies).
//!
//! A backend supplies a [`Harness`] (an isolated, migrated store, e.g. a fresh schema,
//! plus a way to enqueue committed messages) and expands [`store_conformance_tests!`]:
//!
//! ```ignore
//! async fn harness() -> MyHarness { /* fresh schema */ }
//! outbox_core::store_conformance_tests!(harness);
//! ```
//!
//! Each property panics with a message naming what failed.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;

use crate::message::{MessageStatus, NewMessage};
use crate::store::{Completion, CompletionOutcome, MessageFilter, OutboxStore};

/// What a backend provides to run the suite.
#[async_trait]
pub trait Harness: Send + Sync + 'static {
    /// The store under test.
    type Store: OutboxStore;

    /// The store (isolated from every other test).
    fn store(&self) -> Arc<Self::Store>;

    /// Enqueues and commits `messages`; panics on failure.
    async fn enqueue(&self, messages: &[NewMessage]);
}

/// `n` valid messages of event type `event_type`.
pub fn messages(n: usize, event_type: &str) -> Vec<NewMessage> {
    (0..n)
        .map(|i| {
            NewMessage::builder("conformance", format!("agg-{i}"), event_type)
                .aggregate_version(i as i64)
                .payload(&serde_json::json!({ "n": i }))
                .build()
                .expect("valid message")
        })
        .collect()
}

fn completion(id: Uuid, token: Uuid, outcome: CompletionOutcome) -> Completion {
    Completion {
        id,
        claim_token: token,
        outcome,
    }
}

async fn claim_until<S: OutboxStore>(
    store: &S,
    batch: usize,
    lease: Duration,
    want: usize,
) -> Vec<crate::OutboxMessage> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let got = store.claim(batch, lease).await.expect("claim");
        if got.len() >= want || tokio::time::Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Claim sets Processing, a lease in the future, one fresh token and `attempts + 1`,
/// returns messages in `seq` order, and never returns the same message twice while the
/// lease holds.
pub async fn claim_marks_processing<H: Harness>(h: &H) {
    let store = h.store();
    let msgs = messages(5, "Claimed");
    h.enqueue(&msgs).await;
    let claimed = store
        .claim(10, Duration::from_secs(60))
        .await
        .expect("claim");
    assert_eq!(claimed.len(), 5, "all five visible messages are claimed");
    let token = claimed[0].claim_token.expect("claim token set");
    for (i, m) in claimed.iter().enumerate() {
        assert_eq!(m.status, MessageStatus::Processing);
        assert_eq!(m.attempts, 1, "first claim counts one attempt");
        assert_eq!(m.claim_token, Some(token));
        assert!(m.lease_until.expect("lease") > m.created_at);
        assert_eq!(m.id, msgs[i].id, "claimed in seq order");
        assert_eq!(
            m.payload.get(),
            msgs[i].payload.get(),
            "payload round-trips"
        );
    }
    let again = store
        .claim(10, Duration::from_secs(60))
        .await
        .expect("claim");
    assert!(again.is_empty(), "leased messages are not claimed again");
}

/// Four concurrent claimers over 2,000 messages: every message is claimed exactly once.
pub async fn concurrent_claims_are_exclusive<H: Harness>(h: &H) {
    let store = h.store();
    let msgs = messages(2000, "Exclusive");
    h.enqueue(&msgs).await;
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let store = Arc::clone(&store);
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let batch = store
                    .claim(50, Duration::from_secs(60))
                    .await
                    .expect("claim");
                if batch.is_empty() {
                    return mine;
                }
                mine.extend(batch.into_iter().map(|m| m.id));
            }
        }));
    }
    let mut seen = HashSet::new();
    let mut total = 0;
    for t in tasks {
        for id in t.await.expect("task") {
            total += 1;
            assert!(seen.insert(id), "message {id} was claimed twice");
        }
    }
    assert_eq!(total, 2000, "every message claimed once");
}

/// Sent, Retry (hidden until the backoff passes, `last_error` kept), Dead and Release
/// (`attempts` not charged) are applied in one call.
pub async fn completion_applies_each_outcome<H: Harness>(h: &H) {
    let store = h.store();
    h.enqueue(&messages(4, "Outcomes")).await;
    let c = store
        .claim(4, Duration::from_secs(60))
        .await
        .expect("claim");
    assert_eq!(c.len(), 4);
    let t = c[0].claim_token.expect("token");
    let report = store
        .complete(&[
            completion(c[0].id, t, CompletionOutcome::Sent),
            completion(
                c[1].id,
                t,
                CompletionOutcome::Retry {
                    delay: Duration::from_secs(3600),
                    error: "nack from broker".into(),
                },
            ),
            completion(
                c[2].id,
                t,
                CompletionOutcome::Dead {
                    error: "unroutable".into(),
                },
            ),
            completion(c[3].id, t, CompletionOutcome::Release),
        ])
        .await
        .expect("complete");
    assert_eq!(report.applied, 4);
    assert!(report.fenced.is_empty());

    let sent = store.get(c[0].id).await.expect("get").expect("row");
    assert_eq!(sent.status, MessageStatus::Sent);
    assert!(sent.sent_at.is_some());
    assert!(sent.claim_token.is_none());

    let retry = store.get(c[1].id).await.expect("get").expect("row");
    assert_eq!(retry.status, MessageStatus::New);
    assert_eq!(retry.last_error.as_deref(), Some("nack from broker"));
    assert!(retry.visible_at > retry.created_at + chrono::Duration::seconds(3000));

    let dead = store.get(c[2].id).await.expect("get").expect("row");
    assert_eq!(dead.status, MessageStatus::Dead);
    assert_eq!(dead.last_error.as_deref(), Some("unroutable"));

    let released = store.get(c[3].id).await.expect("get").expect("row");
    assert_eq!(released.status, MessageStatus::New);
    assert_eq!(released.attempts, 0, "release does not charge the attempt");

    // Only the released message is claimable now; the retried one waits for its backoff.
    let next = store
        .claim(10, Duration::from_secs(60))
        .await
        .expect("claim");
    assert_eq!(next.iter().map(|m| m.id).collect::<Vec<_>>(), [c[3].id]);
    assert_eq!(next[0].attempts, 1);
}

/// A retry with zero delay is claimable again, with `attempts` 2.
pub async fn retry_becomes_claimable_after_backoff<H: Harness>(h: &H) {
    let store = h.store();
    h.enqueue(&messages(1, "Retry")).await;
    let c = store
        .claim(1, Duration::from_secs(60))
        .await
        .expect("claim");
    let t = c[0].claim_token.expect("token");
    store
        .complete(&[completion(
            c[0].id,
            t,
            CompletionOutcome::Retry {
                delay: Duration::from_millis(200),
                error: "timeout".into(),
            },
        )])
        .await
        .expect("complete");
    let again = claim_until(&*store, 1, Duration::from_secs(60), 1).await;
    assert_eq!(
        again.len(),
        1,
        "retried message is claimable after its backoff"
    );
    assert_eq!(again[0].attempts, 2);
    assert_ne!(again[0].claim_token, Some(t), "a fresh token per claim");
}

/// A message whose lease expired is reclaimed with a new token and attempts + 1; the
/// stale holder's completion is fenced and changes nothing.
pub async fn expired_lease_is_reclaimed_and_stale_completion_fenced<H: Harness>(h: &H) {
    let store = h.store();
    h.enqueue(&messages(3, "Lease")).await;
    let first = store
        .claim(3, Duration::from_millis(300))
        .await
        .expect("claim");
    assert_eq!(first.len(), 3);
    let stale = first[0].claim_token.expect("token");

    let second = claim_until(&*store, 3, Duration::from_secs(60), 3).await;
    assert_eq!(second.len(), 3, "expired leases are reclaimed");
    let fresh = second[0].claim_token.expect("token");
    assert_ne!(stale, fresh);
    assert!(second.iter().all(|m| m.attempts == 2));

    let report = store
        .complete(&[completion(
            first[0].id,
            stale,
            CompletionOutcome::Dead {
                error: "stale".into(),
            },
        )])
        .await
        .expect("complete");
    assert_eq!(report.applied, 0);
    assert_eq!(report.fenced, vec![first[0].id]);
    let row = store.get(first[0].id).await.expect("get").expect("row");
    assert_eq!(
        row.status,
        MessageStatus::Processing,
        "stale completion changed nothing"
    );
    assert_eq!(row.claim_token, Some(fresh));

    let report = store
        .complete(&[completion(first[0].id, fresh, CompletionOutcome::Sent)])
        .await
        .expect("complete");
    assert_eq!(report.applied, 1);
    // Completing twice is fenced too: the token is cleared.
    let report = store
        .complete(&[completion(first[0].id, fresh, CompletionOutcome::Sent)])
        .await
        .expect("complete");
    assert_eq!(report.fenced.len(), 1);
}

/// Dead letters can be listed by filter; a dry run changes nothing; replay resets
/// attempts and makes them claimable.
pub async fn dead_letters_and_replay<H: Harness>(h: &H) {
    let store = h.store();
    let mut msgs = messages(2, "DeadA");
    msgs.extend(messages(1, "DeadB"));
    h.enqueue(&msgs).await;
    let c = store
        .claim(3, Duration::from_secs(60))
        .await
        .expect("claim");
    let t = c[0].claim_token.expect("token");
    let done: Vec<Completion> = c
        .iter()
        .map(|m| {
            completion(
                m.id,
                t,
                CompletionOutcome::Dead {
                    error: format!("boom {}", m.event_type),
                },
            )
        })
        .collect();
    store.complete(&done).await.expect("complete");

    let all = store
        .dead_letters(&MessageFilter::new(), 100)
        .await
        .expect("list");
    assert_eq!(all.len(), 3);
    let only_a = MessageFilter::new().with_event_type("DeadA");
    assert_eq!(
        store.dead_letters(&only_a, 100).await.expect("list").len(),
        2
    );
    let by_error = MessageFilter::new().with_error_containing("BOOM DEADB");
    assert_eq!(
        store
            .dead_letters(&by_error, 100)
            .await
            .expect("list")
            .len(),
        1
    );
    let by_id = MessageFilter::new().with_ids([c[0].id]);
    assert_eq!(
        store.dead_letters(&by_id, 100).await.expect("list").len(),
        1
    );

    let dry = store.replay(&only_a, true).await.expect("dry run");
    assert_eq!((dry.matched, dry.replayed), (2, 0));
    assert_eq!(
        store.stats().await.expect("stats").dead,
        3,
        "dry run changes nothing"
    );

    let real = store.replay(&only_a, false).await.expect("replay");
    assert_eq!((real.matched, real.replayed, real.failed), (2, 2, 0));
    let again = store
        .claim(10, Duration::from_secs(60))
        .await
        .expect("claim");
    assert_eq!(again.len(), 2);
    assert!(
        again
            .iter()
            .all(|m| m.event_type == "DeadA" && m.attempts == 1)
    );
}

/// Stats count rows by status; purge removes only old Sent rows.
pub async fn stats_and_purge<H: Harness>(h: &H) {
    let store = h.store();
    h.enqueue(&messages(4, "Stats")).await;
    let c = store
        .claim(2, Duration::from_secs(60))
        .await
        .expect("claim");
    let t = c[0].claim_token.expect("token");
    store
        .complete(&[completion(c[0].id, t, CompletionOutcome::Sent)])
        .await
        .expect("complete");
    let stats = store.stats().await.expect("stats");
    assert_eq!(
        (stats.new, stats.processing, stats.sent, stats.dead),
        (2, 1, 1, 0)
    );
    assert!(stats.oldest_pending_age.is_some());

    assert_eq!(
        store
            .purge_sent(Duration::from_secs(3600), 100)
            .await
            .expect("purge"),
        0,
        "recent rows are kept"
    );
    assert_eq!(
        store.purge_sent(Duration::ZERO, 100).await.expect("purge"),
        1,
        "only the sent row goes"
    );
    let stats = store.stats().await.expect("stats");
    assert_eq!((stats.new, stats.processing, stats.sent), (2, 1, 0));
}

/// Expands to one `#[tokio::test]` per conformance property. `$harness` is the path of
/// an `async fn() -> impl Harness` that returns a fresh, isolated harness.
#[macro_export]
macro_rules! store_conformance_tests {
    ($harness:path) => {
        mod store_conformance {
            use super::*;
            $crate::store_conformance_tests!(@each $harness;
                claim_marks_processing,
                concurrent_claims_are_exclusive,
                completion_applies_each_outcome,
                retry_becomes_claimable_after_backoff,
                expired_lease_is_reclaimed_and_stale_completion_fenced,
                dead_letters_and_replay,
                stats_and_purge,
            );
        }
    };
    (@each $harness:path; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let h = $harness().await;
                $crate::conformance::$name(&h).await;
            }
        )*
    };
}
