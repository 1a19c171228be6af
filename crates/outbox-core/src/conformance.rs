//! The store conformance suite: the properties of [`OutboxStore`] stated once, run by
//! every backend against itself (enable the `conformance` feature in dev-dependencies).
//!
//! A backend supplies a [`Harness`] (an isolated, migrated store, e.g. a fresh schema,
//! plus a way to enqueue committed messages) and expands [`store_conformance_tests!`](crate::store_conformance_tests):
//!
//! ```ignore
//! async fn harness() -> MyHarness { /* fresh schema */ }
//! outboxkit_core::store_conformance_tests!(harness);
//! ```
//!
//! Each property panics with a message naming what failed.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;

use crate::message::{MessageStatus, NewMessage, OutboxMessage};
use crate::ordering::OnDead;
use crate::store::{
    Completion, CompletionOutcome, DEFAULT_CRASH_LOOP_LIMIT, MAX_ERROR_BYTES, MessageFilter,
    OutboxStore, Poison,
};

/// What a backend provides to run the suite.
#[async_trait]
pub trait Harness: Send + Sync + 'static {
    /// The store under test.
    type Store: OutboxStore;

    /// The store (isolated from every other test), with the default
    /// [`SentRetention::Keep`](crate::SentRetention::Keep).
    fn store(&self) -> Arc<Self::Store>;

    /// A store over the same tables as [`store`](Self::store), configured with
    /// [`SentRetention::Delete`](crate::SentRetention::Delete).
    fn store_deleting_sent(&self) -> Arc<Self::Store>;

    /// Enqueues and commits `messages`; panics on failure.
    async fn enqueue(&self, messages: &[NewMessage]);

    /// Overwrites the stored `headers` of message `id` with the JSON text `json`, as a
    /// trigger, a migration or another language's producer might; panics on failure.
    async fn set_headers_json(&self, id: Uuid, json: &str);
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
        let got = store.claim(batch, lease).await.expect("claim").messages;
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
        .expect("claim")
        .messages;
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
        .expect("claim")
        .messages;
    assert!(again.is_empty(), "leased messages are not claimed again");
}

/// A claimed row whose headers are not a JSON object of strings does not fail the claim:
/// it comes back as [`Poison::Undecodable`] under the claim's token, beside the rest of
/// the batch; completing it `Dead` records the reason, and the dead letters listing shows
/// it (its headers made into strings).
pub async fn undecodable_rows_are_poison_alone<H: Harness>(h: &H) {
    let store = h.store();
    let msgs = messages(3, "Poison");
    h.enqueue(&msgs).await;
    h.set_headers_json(msgs[1].id, r#"{"retries": 3}"#).await;
    let batch = store
        .claim(10, Duration::from_secs(60))
        .await
        .expect("a poison row does not fail the claim");
    let ids: Vec<Uuid> = batch.messages.iter().map(|m| m.id).collect();
    assert_eq!(
        ids,
        vec![msgs[0].id, msgs[2].id],
        "the good rows are claimed"
    );
    assert_eq!(batch.poison.len(), 1, "one poison row: {:?}", batch.poison);
    let poison = &batch.poison[0];
    assert_eq!(poison.id, msgs[1].id);
    assert!(poison.seq > batch.messages[0].seq, "seq is read");
    assert_eq!(poison.aggregate_id, msgs[1].aggregate_id);
    let token = batch.messages[0].claim_token.expect("token");
    match &poison.poison {
        Poison::Undecodable {
            claim_token,
            reason,
        } => {
            assert_eq!(*claim_token, token, "claimed under the batch's token");
            assert!(
                reason.contains("retries"),
                "the reason names the header: {reason}"
            );
        }
        other => panic!("expected Undecodable, got {other:?}"),
    }
    let mut completions: Vec<Completion> = batch
        .messages
        .iter()
        .map(|m| completion(m.id, token, CompletionOutcome::Sent))
        .collect();
    completions.push(completion(
        poison.id,
        token,
        CompletionOutcome::Dead {
            error: poison.poison.to_string(),
        },
    ));
    let report = store.complete(&completions).await.expect("complete");
    assert_eq!(report.applied, 3);
    let dead = store
        .dead_letters(&MessageFilter::new(), 10)
        .await
        .expect("dead letters are listed despite the bad headers");
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, msgs[1].id);
    assert_eq!(
        dead[0].headers.get("retries").map(String::as_str),
        Some("3")
    );
    assert!(
        dead[0]
            .last_error
            .as_deref()
            .is_some_and(|e| e.starts_with("undecodable row")),
        "{:?}",
        dead[0].last_error
    );
}

/// The crash-loop guard isolates, then kills only the crashing row. Four rows are
/// claimed together and their claimer vanishes (its lease runs out). From then on each
/// is a suspect: the first in claim order is claimed **alone**, never beside another
/// row. The first row "crashes" every claimer that takes it: after
/// [`DEFAULT_CRASH_LOOP_LIMIT`] claims alone without an outcome the next claim moves it
/// to `Dead` and returns it as [`Poison::CrashLoop`], and nothing else. Its three
/// batch-mates are then claimed alone once each and sent: none is dead. The vanished
/// claimer's late completion is fenced; released rows (an outcome) are claimed in a
/// batch as usual; a replayed row starts a new count.
pub async fn crash_loop_guard_isolates_and_kills_only_the_crashing_row<H: Harness>(h: &H) {
    let store = h.store();
    let msgs = messages(4, "CrashLoop");
    h.enqueue(&msgs).await;
    let vanish = Duration::from_millis(1);
    let together = claim_until(&*store, 10, vanish, 4).await;
    assert_eq!(together.len(), 4, "claimed together first");
    let mut last_token = together[0].claim_token;
    for round in 0..DEFAULT_CRASH_LOOP_LIMIT {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let batch = store.claim(10, vanish).await.expect("claim");
        assert!(batch.poison.is_empty(), "round {round}: {:?}", batch.poison);
        let ids: Vec<Uuid> = batch.messages.iter().map(|m| m.id).collect();
        assert_eq!(
            ids,
            vec![msgs[0].id],
            "round {round}: the first suspect is claimed alone"
        );
        last_token = batch.messages[0].claim_token;
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let batch = store
        .claim(10, Duration::from_secs(60))
        .await
        .expect("claim");
    assert!(
        batch.messages.is_empty(),
        "the claim that kills returns nothing else: {:?}",
        batch.messages
    );
    assert_eq!(
        batch
            .poison
            .iter()
            .map(|p| (p.id, p.poison.clone()))
            .collect::<Vec<_>>(),
        vec![(
            msgs[0].id,
            Poison::CrashLoop {
                claims_alone: DEFAULT_CRASH_LOOP_LIMIT
            }
        )]
    );
    let dead = store.get(msgs[0].id).await.expect("get").expect("row");
    assert_eq!(dead.status, MessageStatus::Dead);
    assert_eq!(dead.claim_token, None);
    assert!(
        dead.last_error
            .as_deref()
            .is_some_and(|e| e.starts_with("suspected crash loop")),
        "{:?}",
        dead.last_error
    );
    // The batch-mates, each alone once, then sent.
    for (i, mate) in msgs[1..].iter().enumerate() {
        let batch = store
            .claim(10, Duration::from_secs(60))
            .await
            .expect("claim");
        let ids: Vec<Uuid> = batch.messages.iter().map(|m| m.id).collect();
        assert_eq!(ids, vec![mate.id], "batch-mate {i} alone, in claim order");
        let token = batch.messages[0].claim_token.expect("token");
        let sent = store
            .complete(&[completion(mate.id, token, CompletionOutcome::Sent)])
            .await
            .expect("complete");
        assert_eq!(sent.applied, 1);
    }
    let stats = store.stats().await.expect("stats");
    assert_eq!(
        (stats.sent, stats.dead),
        (3, 1),
        "only the crashing row is dead"
    );
    let late = store
        .complete(&[completion(
            msgs[0].id,
            last_token.expect("claimed"),
            CompletionOutcome::Sent,
        )])
        .await
        .expect("complete");
    assert_eq!(
        late.fenced,
        vec![msgs[0].id],
        "the vanished claimer is fenced"
    );

    // Released rows are not suspects: claimed together again.
    let more = messages(2, "Released");
    h.enqueue(&more).await;
    let first = claim_until(&*store, 10, Duration::from_secs(60), 2).await;
    assert_eq!(first.len(), 2);
    let released: Vec<Completion> = first
        .iter()
        .map(|m| {
            completion(
                m.id,
                m.claim_token.expect("token"),
                CompletionOutcome::Release,
            )
        })
        .collect();
    assert_eq!(store.complete(&released).await.expect("release").applied, 2);
    let again = claim_until(&*store, 10, Duration::from_secs(60), 2).await;
    assert_eq!(again.len(), 2, "released rows are claimed together");
    let sent: Vec<Completion> = again
        .iter()
        .map(|m| completion(m.id, m.claim_token.expect("token"), CompletionOutcome::Sent))
        .collect();
    assert_eq!(store.complete(&sent).await.expect("complete").applied, 2);

    let replayed = store
        .replay(&MessageFilter::new().with_ids([msgs[0].id]), false)
        .await
        .expect("replay");
    assert_eq!(replayed.replayed, 1);
    let again = claim_until(&*store, 10, Duration::from_secs(60), 1).await;
    assert_eq!(
        again.iter().map(|m| m.id).collect::<Vec<_>>(),
        vec![msgs[0].id],
        "a replayed row starts a new count: claimed, not killed again"
    );
}

/// sanitized (NUL as `\0`, cut at a character boundary) and never fails the completion.
pub async fn error_texts_are_stored_sanitized<H: Harness>(h: &H) {
    let store = h.store();
    let msgs = messages(2, "Sanitized");
    h.enqueue(&msgs).await;
    let batch = claim_until(&*store, 10, Duration::from_secs(60), 2).await;
    let token = batch[0].claim_token.expect("token");
    let report = store
        .complete(&[
            completion(
                msgs[0].id,
                token,
                CompletionOutcome::Dead {
                    error: "broker said \0 no".into(),
                },
            ),
            completion(
                msgs[1].id,
                token,
                CompletionOutcome::Retry {
                    delay: Duration::from_secs(60),
                    error: "é".repeat(MAX_ERROR_BYTES),
                },
            ),
        ])
        .await
        .expect("a NUL byte or a long text does not fail the completion");
    assert_eq!(report.applied, 2);
    let dead = store.get(msgs[0].id).await.expect("get").expect("row");
    assert_eq!(dead.last_error.as_deref(), Some("broker said \\0 no"));
    let retried = store.get(msgs[1].id).await.expect("get").expect("row");
    let text = retried.last_error.expect("error");
    assert!(
        text.len() <= MAX_ERROR_BYTES && text.ends_with('…'),
        "{}",
        text.len()
    );
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
                    .expect("claim")
                    .messages;
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

/// Claims the four messages just enqueued and completes them in one call: the first
/// `Sent`, the second `Retry` (1 h backoff, "nack from broker"), the third `Dead`
/// ("unroutable"), the fourth `Release`. Checks that all four were applied and that the
/// last three are recorded (the retry hidden behind its backoff with `last_error` kept,
/// the release not charged); returns the claimed messages.
async fn one_outcome_each<S: OutboxStore>(store: &S) -> Vec<OutboxMessage> {
    let c = store
        .claim(4, Duration::from_secs(60))
        .await
        .expect("claim")
        .messages;
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
    assert_eq!(report.applied, 4, "every outcome is applied");
    assert!(report.fenced.is_empty());

    let retry = store.get(c[1].id).await.expect("get").expect("retried row");
    assert_eq!(retry.status, MessageStatus::New);
    assert_eq!(retry.last_error.as_deref(), Some("nack from broker"));
    assert!(retry.visible_at > retry.created_at + chrono::Duration::seconds(3000));

    let dead = store.get(c[2].id).await.expect("get").expect("dead row");
    assert_eq!(dead.status, MessageStatus::Dead);
    assert_eq!(dead.last_error.as_deref(), Some("unroutable"));

    let released = store
        .get(c[3].id)
        .await
        .expect("get")
        .expect("released row");
    assert_eq!(released.status, MessageStatus::New);
    assert_eq!(released.attempts, 0, "release does not charge the attempt");
    c
}

/// Sent, Retry (hidden until the backoff passes, `last_error` kept), Dead and Release
/// (`attempts` not charged) are applied in one call.
pub async fn completion_applies_each_outcome<H: Harness>(h: &H) {
    let store = h.store();
    h.enqueue(&messages(4, "Outcomes")).await;
    let c = one_outcome_each(&*store).await;
    let sent = store.get(c[0].id).await.expect("get").expect("row");
    assert_eq!(sent.status, MessageStatus::Sent);
    assert!(sent.sent_at.is_some());
    assert!(sent.claim_token.is_none());

    // Only the released message is claimable now; the retried one waits for its backoff.
    let next = store
        .claim(10, Duration::from_secs(60))
        .await
        .expect("claim")
        .messages;
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
        .expect("claim")
        .messages;
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

fn hold(destination: &str) -> CompletionOutcome {
    CompletionOutcome::Hold {
        destination: destination.into(),
        error: "queue full".into(),
    }
}

fn routed(aggregate_id: &str, routing_key: &str, partition_key: Option<&str>) -> NewMessage {
    let mut b = NewMessage::builder("conformance", aggregate_id, "Routed")
        .routing_key(routing_key)
        .payload(&serde_json::json!({ "id": aggregate_id }));
    if let Some(k) = partition_key {
        b = b.partition_key(k);
    }
    b.build().expect("valid message")
}

/// A held row ([`CompletionOutcome::Hold`]) is handed back without charge and stays out
/// of every claim until its destination's trial: [`OutboxStore::claim_held`] takes the
/// oldest held row of each destination asked for (none for a destination that holds
/// nothing), a refused trial holds it again, and [`OutboxStore::release_held`] makes the
/// destination's rows claimable again, `limit` at a time. [`OutboxStore::held_destinations`]
/// lists the destinations that hold rows, paged by name.
pub async fn held_rows_wait_for_their_destination_trial<H: Harness>(h: &H) {
    let store = h.store();
    let lease = Duration::from_secs(60);
    let held: Vec<NewMessage> = (0..3)
        .map(|i| routed(&format!("h-{i}"), "full", None))
        .collect();
    let other = routed("o-0", "free", None);
    h.enqueue(&held).await;
    h.enqueue(std::slice::from_ref(&other)).await;
    let claimed = claim_until(&*store, 10, lease, 4).await;
    assert_eq!(claimed.len(), 4);
    let completions: Vec<Completion> = claimed
        .iter()
        .map(|m| {
            let outcome = if m.id == other.id {
                CompletionOutcome::Release
            } else {
                hold("full")
            };
            completion(m.id, m.claim_token.expect("token"), outcome)
        })
        .collect();
    assert_eq!(store.complete(&completions).await.expect("hold").applied, 4);
    let row = store.get(held[0].id).await.expect("get").expect("row");
    assert_eq!(row.status, MessageStatus::New);
    assert_eq!(row.attempts, 0, "no attempt charged");
    assert_eq!(row.last_error.as_deref(), Some("queue full"));

    let again = claim_until(&*store, 10, lease, 1).await;
    assert_eq!(
        again.iter().map(|m| m.id).collect::<Vec<_>>(),
        [other.id],
        "held rows are not claimed; the other destination's row is"
    );
    let token = again[0].claim_token.expect("token");
    store
        .complete(&[completion(other.id, token, CompletionOutcome::Sent)])
        .await
        .expect("sent");
    assert!(
        store.claim(10, lease).await.expect("claim").is_empty(),
        "held rows wait for their trial"
    );
    assert_eq!(
        store.held_destinations("", 10).await.expect("list"),
        ["full"]
    );
    assert!(
        store
            .held_destinations("full", 10)
            .await
            .expect("list")
            .is_empty(),
        "paged after the name"
    );

    // The trial: the oldest held row of each destination asked for, alone.
    let trial = store
        .claim_held(&["full".into(), "empty".into()], lease, None)
        .await
        .expect("claim_held")
        .messages;
    assert_eq!(trial.iter().map(|m| m.id).collect::<Vec<_>>(), [held[0].id]);
    assert_eq!(trial[0].status, MessageStatus::Processing);
    assert_eq!(trial[0].attempts, 1);
    // Refused again: held again.
    let token = trial[0].claim_token.expect("token");
    store
        .complete(&[completion(held[0].id, token, hold("full"))])
        .await
        .expect("hold");
    let trial = store
        .claim_held(&["full".into()], lease, None)
        .await
        .expect("claim_held")
        .messages;
    assert_eq!(trial.iter().map(|m| m.id).collect::<Vec<_>>(), [held[0].id]);
    let token = trial[0].claim_token.expect("token");
    store
        .complete(&[completion(held[0].id, token, CompletionOutcome::Sent)])
        .await
        .expect("sent");
    // Confirmed: the rest is released, in chunks.
    assert_eq!(store.release_held("full", 1).await.expect("release"), 1);
    assert_eq!(store.release_held("full", 10).await.expect("release"), 1);
    assert_eq!(store.release_held("full", 10).await.expect("release"), 0);
    assert!(
        store
            .held_destinations("", 10)
            .await
            .expect("list")
            .is_empty()
    );
    let released = claim_until(&*store, 10, lease, 2).await;
    let mut ids: Vec<Uuid> = released.iter().map(|m| m.id).collect();
    ids.sort();
    let mut want = vec![held[1].id, held[2].id];
    want.sort();
    assert_eq!(ids, want, "released rows are claimable again");
    for m in &released {
        assert_eq!(m.attempts, 1, "never charged while held");
    }
}

/// In per-key order a held row blocks the later rows of its key, and its destination's
/// trial takes only a held row that heads its key.
pub async fn ordered_held_row_blocks_its_key<H: Harness>(h: &H) {
    let store = h.store();
    let lease = Duration::from_secs(60);
    let k0 = routed("k-0", "full", Some("k"));
    let k1 = routed("k-1", "free", Some("k"));
    h.enqueue(&[k0.clone(), k1.clone()]).await;
    let run = store
        .claim_ordered(10, lease, OnDead::Block)
        .await
        .expect("claim")
        .messages;
    assert_eq!(run.len(), 2);
    let token = run[0].claim_token.expect("token");
    store
        .complete(&[
            completion(k0.id, token, hold("full")),
            completion(k1.id, token, CompletionOutcome::Release),
        ])
        .await
        .expect("complete");
    assert!(
        store
            .claim_ordered(10, lease, OnDead::Block)
            .await
            .expect("claim")
            .is_empty(),
        "the held head blocks its key"
    );
    // A held row behind an earlier pending row of its key is not tried in order.
    let j0 = routed("j-0", "free", Some("j"));
    let j1 = routed("j-1", "other-full", Some("j"));
    h.enqueue(&[j0.clone(), j1.clone()]).await;
    let run = store
        .claim_ordered(10, lease, OnDead::Block)
        .await
        .expect("claim")
        .messages;
    assert_eq!(run.iter().map(|m| m.id).collect::<Vec<_>>(), [j0.id, j1.id]);
    let token = run[0].claim_token.expect("token");
    store
        .complete(&[
            completion(
                j0.id,
                token,
                CompletionOutcome::Retry {
                    delay: Duration::from_secs(600),
                    error: "later".into(),
                },
            ),
            completion(j1.id, token, hold("other-full")),
        ])
        .await
        .expect("complete");
    let dests = ["full".to_owned(), "other-full".to_owned()];
    let trial = store
        .claim_held(&dests, lease, Some(OnDead::Block))
        .await
        .expect("claim_held")
        .messages;
    assert_eq!(
        trial.iter().map(|m| m.id).collect::<Vec<_>>(),
        [k0.id],
        "only a held head is tried in order"
    );
    let token = trial[0].claim_token.expect("token");
    store
        .complete(&[completion(k0.id, token, CompletionOutcome::Sent)])
        .await
        .expect("sent");
    let next = store
        .claim_ordered(10, lease, OnDead::Block)
        .await
        .expect("claim")
        .messages;
    assert_eq!(
        next.iter().map(|m| m.id).collect::<Vec<_>>(),
        [k1.id],
        "its key moves on once the trial is sent"
    );
}

/// A message whose lease expired is reclaimed (alone: its claim ended without an
/// outcome) with a new token and attempts + 1; the stale holder's completion is fenced
/// and changes nothing.
pub async fn expired_lease_is_reclaimed_and_stale_completion_fenced<H: Harness>(h: &H) {
    let store = h.store();
    h.enqueue(&messages(3, "Lease")).await;
    let first = store
        .claim(3, Duration::from_millis(300))
        .await
        .expect("claim")
        .messages;
    assert_eq!(first.len(), 3);
    let stale = first[0].claim_token.expect("token");

    // Reclaimed after the lease, each alone (a suspect: its claim had no outcome).
    let second = claim_until(&*store, 3, Duration::from_secs(60), 1).await;
    assert_eq!(
        second.iter().map(|m| m.id).collect::<Vec<_>>(),
        vec![first[0].id],
        "an expired row is reclaimed, alone"
    );
    let fresh = second[0].claim_token.expect("token");
    assert_ne!(stale, fresh);
    assert_eq!(second[0].attempts, 2);

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

/// Under [`SentRetention::Delete`](crate::SentRetention::Delete) a `Sent` completion
/// deletes the row, and nothing else changes: Retry, Dead and Release are recorded as
/// under `Keep`, a second `Sent` completion is fenced, and a stale holder's `Sent`
/// completion is fenced and deletes nothing.
pub async fn sent_retention_delete_removes_only_confirmed_rows<H: Harness>(h: &H) {
    let store = h.store_deleting_sent();
    h.enqueue(&messages(4, "DeleteOnSent")).await;
    let c = one_outcome_each(&*store).await;
    assert!(
        store.get(c[0].id).await.expect("get").is_none(),
        "the sent message's row is deleted"
    );
    let stats = store.stats().await.expect("stats");
    assert_eq!(
        (stats.new, stats.processing, stats.sent, stats.dead),
        (2, 0, 0, 1),
        "no sent rows are kept"
    );

    let again = store
        .complete(&[completion(
            c[0].id,
            c[0].claim_token.expect("token"),
            CompletionOutcome::Sent,
        )])
        .await
        .expect("complete");
    assert_eq!((again.applied, again.fenced), (0, vec![c[0].id]));

    // A holder whose lease expired and was taken over deletes nothing.
    let first = store
        .claim(1, Duration::from_millis(300))
        .await
        .expect("claim")
        .messages;
    assert_eq!(first.iter().map(|m| m.id).collect::<Vec<_>>(), [c[3].id]);
    let stale = first[0].claim_token.expect("token");
    let second = claim_until(&*store, 1, Duration::from_secs(60), 1).await;
    assert_eq!(second.len(), 1, "the expired lease is reclaimed");
    let fresh = second[0].claim_token.expect("token");
    let report = store
        .complete(&[completion(c[3].id, stale, CompletionOutcome::Sent)])
        .await
        .expect("complete");
    assert_eq!((report.applied, report.fenced), (0, vec![c[3].id]));
    let row = store.get(c[3].id).await.expect("get").expect("row kept");
    assert_eq!(row.status, MessageStatus::Processing);
    assert_eq!(
        row.claim_token,
        Some(fresh),
        "the stale completion changed nothing"
    );
    let report = store
        .complete(&[completion(c[3].id, fresh, CompletionOutcome::Sent)])
        .await
        .expect("complete");
    assert_eq!(report.applied, 1);
    assert!(store.get(c[3].id).await.expect("get").is_none());

    // The same tables under the default retention keep what they send.
    let keeping = h.store();
    h.enqueue(&messages(1, "KeptOnSent")).await;
    let k = keeping
        .claim(1, Duration::from_secs(60))
        .await
        .expect("claim")
        .messages;
    assert_eq!(k.len(), 1);
    let kt = k[0].claim_token.expect("token");
    keeping
        .complete(&[completion(k[0].id, kt, CompletionOutcome::Sent)])
        .await
        .expect("complete");
    let kept = keeping.get(k[0].id).await.expect("get").expect("row kept");
    assert_eq!(kept.status, MessageStatus::Sent);
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
        .expect("claim")
        .messages;
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
        .expect("claim")
        .messages;
    assert_eq!(again.len(), 2);
    assert!(
        again
            .iter()
            .all(|m| m.event_type == "DeadA" && m.attempts == 1)
    );
}

/// The error filter of dead-letter listing and replay matches literal text,
/// case-insensitively: `%`, `_`, `[` and `\` match only themselves.
pub async fn dead_letter_error_filter_is_literal<H: Harness>(h: &H) {
    let store = h.store();
    let msgs = messages(6, "Literal");
    h.enqueue(&msgs).await;
    let claimed = claim_until(&*store, 6, Duration::from_secs(60), 6).await;
    assert_eq!(claimed.len(), 6, "claimed every message");
    let errors = [
        "plain error",
        "rate 100% reached",
        "no_route",
        "path C:\\temp",
        "bracket [x] here",
        "MiXeD Case",
    ];
    let dead: Vec<Completion> = claimed
        .iter()
        .zip(errors)
        .map(|(m, error)| {
            completion(
                m.id,
                m.claim_token.expect("token"),
                CompletionOutcome::Dead {
                    error: error.to_owned(),
                },
            )
        })
        .collect();
    store.complete(&dead).await.expect("complete");
    let id_of = |error: &str| {
        claimed[errors
            .iter()
            .position(|e| *e == error)
            .expect("known error")]
        .id
    };
    for (filter, expected) in [
        ("%", vec!["rate 100% reached"]),
        ("100%", vec!["rate 100% reached"]),
        ("_", vec!["no_route"]),
        ("o_r", vec!["no_route"]),
        // As a LIKE pattern `e_r` would match the `err` of "plain error".
        ("e_r", vec![]),
        ("\\", vec!["path C:\\temp"]),
        ("[x]", vec!["bracket [x] here"]),
        ("[a-z]", vec![]),
        ("mixed case", vec!["MiXeD Case"]),
    ] {
        let filter_of = || MessageFilter::new().with_error_containing(filter);
        let got: HashSet<Uuid> = store
            .dead_letters(&filter_of(), 100)
            .await
            .expect("list")
            .iter()
            .map(|m| m.id)
            .collect();
        let want: HashSet<Uuid> = expected.iter().map(|e| id_of(e)).collect();
        assert_eq!(got, want, "dead letters whose error contains {filter:?}");
        let dry = store.replay(&filter_of(), true).await.expect("dry run");
        assert_eq!(dry.matched, want.len() as u64, "replay matching {filter:?}");
    }
    let replayed = store
        .replay(&MessageFilter::new().with_error_containing("_"), false)
        .await
        .expect("replay");
    assert_eq!((replayed.matched, replayed.replayed), (1, 1));
    assert_eq!(store.stats().await.expect("stats").dead, 5);
}

/// Stats count rows by status; purge removes only old Sent rows.
pub async fn stats_and_purge<H: Harness>(h: &H) {
    let store = h.store();
    h.enqueue(&messages(4, "Stats")).await;
    let c = store
        .claim(2, Duration::from_secs(60))
        .await
        .expect("claim")
        .messages;
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

/// The oldest pending age counts a message from when it became due: a message delayed
/// 1 hour is not late before its time; a due message waiting out a retry backoff (or a
/// deferral: both record a failure) is late, counted from its first failure.
pub async fn pending_age_counts_from_when_due<H: Harness>(h: &H) {
    let store = h.store();
    let delayed = NewMessage::builder("conformance", "later", "Lag")
        .payload(&serde_json::json!({ "in": "1h" }))
        .deliver_after(Duration::from_secs(3600))
        .build()
        .expect("valid message");
    h.enqueue(&[delayed]).await;
    let stats = store.stats().await.expect("stats");
    assert_eq!(stats.new, 1);
    assert_eq!(
        stats.oldest_pending_age, None,
        "a message delayed 1 hour is not late before it is due"
    );
    h.enqueue(&messages(1, "Lag")).await;
    assert!(
        store
            .stats()
            .await
            .expect("stats")
            .oldest_pending_age
            .is_some()
    );
    let c = claim_until(&*store, 10, Duration::from_secs(60), 1).await;
    assert_eq!(c.len(), 1, "only the due message is claimed");
    store
        .complete(&[completion(
            c[0].id,
            c[0].claim_token.expect("token"),
            CompletionOutcome::Retry {
                delay: Duration::from_secs(3600),
                error: "timeout".into(),
            },
        )])
        .await
        .expect("complete");
    let age = store
        .stats()
        .await
        .expect("stats")
        .oldest_pending_age
        .expect("a due message waiting out a retry backoff is late");
    assert!(
        age < Duration::from_secs(60),
        "counted from its first failure: {age:?}"
    );
}

/// Messages `(key, n)` for each pair, interleaved round-robin across keys in the order
/// given (so `seq` interleaves keys); payload `{"key": key, "n": n}` with `n` counting
/// from 0 per key.
pub fn keyed(keys: &[&str], per_key: usize, event_type: &str) -> Vec<NewMessage> {
    let mut out = Vec::with_capacity(keys.len() * per_key);
    for n in 0..per_key {
        for key in keys {
            out.push(
                NewMessage::builder("conformance", format!("{key}-{n}"), event_type)
                    .partition_key(*key)
                    .payload(&serde_json::json!({ "key": key, "n": n }))
                    .build()
                    .expect("valid message"),
            );
        }
    }
    out
}

fn key_of(m: &OutboxMessage) -> String {
    m.order_key().to_string()
}

fn n_of(m: &OutboxMessage) -> u64 {
    let v: serde_json::Value = serde_json::from_str(m.payload.get()).expect("payload");
    v["n"].as_u64().expect("n")
}

/// Checks that `batch` holds, for each key, consecutive messages starting at
/// `next[key]` (updated), in `seq` order.
fn assert_key_prefixes(batch: &[OutboxMessage], next: &mut std::collections::HashMap<String, u64>) {
    let mut last_seq = i64::MIN;
    for m in batch {
        assert!(
            m.seq > last_seq,
            "claim_ordered returns messages in seq order"
        );
        last_seq = m.seq;
        let expected = next.entry(key_of(m)).or_insert(0);
        assert_eq!(
            n_of(m),
            *expected,
            "key {} must be claimed in order, without gaps",
            key_of(m)
        );
        *expected += 1;
    }
}

/// Per-key claim: every key's run comes in `seq` order; a key with a message in flight
/// is not claimed again; a batch too small for all runs splits them into prefixes.
pub async fn ordered_claim_takes_key_prefixes<H: Harness>(h: &H) {
    let store = h.store();
    let lease = Duration::from_secs(60);
    h.enqueue(&keyed(&["a", "b", "c"], 4, "Ordered")).await;
    let mut next = std::collections::HashMap::new();

    let first = store
        .claim_ordered(6, lease, OnDead::Block)
        .await
        .expect("claim")
        .messages;
    assert_eq!(first.len(), 6, "6 = 3 keys x 2 from each run");
    assert_key_prefixes(&first, &mut next);
    assert!(next.values().all(|&n| n == 2), "two of each key: {next:?}");
    assert!(
        store
            .claim_ordered(100, lease, OnDead::Block)
            .await
            .expect("claim")
            .messages
            .is_empty(),
        "every key has messages in flight: nothing may be claimed"
    );
    assert!(
        store
            .claim_ordered(100, lease, OnDead::Skip)
            .await
            .expect("claim")
            .messages
            .is_empty(),
        "in-flight messages block under Skip too"
    );
    // Finish key a only: its rest becomes claimable, b and c stay held.
    let token = first[0].claim_token.expect("token");
    let done_a: Vec<Completion> = first
        .iter()
        .filter(|m| key_of(m) == "a")
        .map(|m| completion(m.id, token, CompletionOutcome::Sent))
        .collect();
    store.complete(&done_a).await.expect("complete");
    let second = store
        .claim_ordered(100, lease, OnDead::Block)
        .await
        .expect("claim")
        .messages;
    assert_eq!(second.len(), 2, "only key a's last two are free");
    assert_key_prefixes(&second, &mut next);
    assert!(second.iter().all(|m| key_of(m) == "a"));
}

/// A failing head blocks its own key only: during its backoff the key's later messages
/// wait while other keys flow; afterwards the key resumes in order. The blocked key is
/// reported by `blocked_keys`.
pub async fn ordered_failing_key_waits_alone<H: Harness>(h: &H) {
    let store = h.store();
    let lease = Duration::from_secs(60);
    h.enqueue(&keyed(&["slow", "fast"], 2, "Ordered")).await;
    let batch = store
        .claim_ordered(10, lease, OnDead::Block)
        .await
        .expect("claim")
        .messages;
    assert_eq!(batch.len(), 4);
    let token = batch[0].claim_token.expect("token");
    let outcomes: Vec<Completion> = batch
        .iter()
        .map(|m| {
            let outcome = match (key_of(m).as_str(), n_of(m)) {
                ("slow", 0) => CompletionOutcome::Retry {
                    delay: Duration::from_secs(2),
                    error: "broker said no".into(),
                },
                ("slow", _) => CompletionOutcome::Release,
                _ => CompletionOutcome::Sent,
            };
            completion(m.id, token, outcome)
        })
        .collect();
    store.complete(&outcomes).await.expect("complete");
    h.enqueue(&keyed(&["fast"], 1, "Ordered2")).await;

    let during = store
        .claim_ordered(10, lease, OnDead::Block)
        .await
        .expect("claim")
        .messages;
    assert_eq!(
        during.len(),
        1,
        "only the other key flows during the backoff"
    );
    assert_eq!(key_of(&during[0]), "fast");
    let blocked = store.blocked_keys(10).await.expect("blocked keys");
    assert_eq!(blocked.len(), 1, "one blocked key: {blocked:?}");
    assert!(blocked[0].key.contains("slow"), "{:?}", blocked[0]);
    assert_eq!(blocked[0].status, MessageStatus::New);
    assert_eq!(blocked[0].attempts, 1);
    assert_eq!(blocked[0].waiting, 1);
    assert_eq!(blocked[0].last_error.as_deref(), Some("broker said no"));
    assert!(blocked[0].blocked_since.is_some() && blocked[0].retry_at.is_some());

    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let after = loop {
        let got = store
            .claim_ordered(10, lease, OnDead::Block)
            .await
            .expect("claim")
            .messages;
        if !got.is_empty() || tokio::time::Instant::now() > deadline {
            break got;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut next = std::collections::HashMap::new();
    assert_key_prefixes(&after, &mut next);
    assert_eq!(
        after.len(),
        2,
        "after the backoff the key resumes with its head"
    );
    assert_eq!(after[0].attempts, 2, "the head's second attempt");
    assert_eq!(
        after[1].attempts, 1,
        "the released successor was not charged"
    );
}

/// A Dead head blocks its key under `OnDead::Block` (until replayed, then it goes
/// first) and is passed over under `OnDead::Skip`.
pub async fn ordered_dead_head_blocks_or_skips<H: Harness>(h: &H) {
    let store = h.store();
    let lease = Duration::from_secs(60);
    h.enqueue(&keyed(&["k"], 3, "Ordered")).await;
    let batch = store
        .claim_ordered(10, lease, OnDead::Block)
        .await
        .expect("claim")
        .messages;
    assert_eq!(batch.len(), 3);
    let token = batch[0].claim_token.expect("token");
    let mut outcomes = vec![completion(
        batch[0].id,
        token,
        CompletionOutcome::Dead {
            error: "unroutable".into(),
        },
    )];
    outcomes.extend(
        batch[1..]
            .iter()
            .map(|m| completion(m.id, token, CompletionOutcome::Release)),
    );
    store.complete(&outcomes).await.expect("complete");

    assert!(
        store
            .claim_ordered(10, lease, OnDead::Block)
            .await
            .expect("claim")
            .messages
            .is_empty(),
        "Block: the dead head stops its key"
    );
    let blocked = store.blocked_keys(10).await.expect("blocked keys");
    assert_eq!(blocked.len(), 1);
    assert_eq!(blocked[0].head_id, batch[0].id);
    assert_eq!(blocked[0].status, MessageStatus::Dead);
    assert_eq!(blocked[0].waiting, 2);

    // Replayed, the dead head goes first again.
    let report = store
        .replay(&MessageFilter::new().with_ids([batch[0].id]), false)
        .await
        .expect("replay");
    assert_eq!(report.replayed, 1);
    let again = store
        .claim_ordered(10, lease, OnDead::Block)
        .await
        .expect("claim")
        .messages;
    let mut next = std::collections::HashMap::new();
    assert_key_prefixes(&again, &mut next);
    assert_eq!(again.len(), 3, "replayed head and its successors, in order");

    // Dead again; under Skip the successors go on without it.
    let token = again[0].claim_token.expect("token");
    let mut outcomes = vec![completion(
        again[0].id,
        token,
        CompletionOutcome::Dead {
            error: "unroutable".into(),
        },
    )];
    outcomes.extend(
        again[1..]
            .iter()
            .map(|m| completion(m.id, token, CompletionOutcome::Release)),
    );
    store.complete(&outcomes).await.expect("complete");
    let skipped = store
        .claim_ordered(10, lease, OnDead::Skip)
        .await
        .expect("claim")
        .messages;
    assert_eq!(
        skipped.iter().map(n_of).collect::<Vec<_>>(),
        vec![1, 2],
        "Skip: the key continues after its dead message"
    );
}

/// A delayed (not yet visible) message holds back its key's later messages.
pub async fn ordered_delayed_message_holds_its_key<H: Harness>(h: &H) {
    let store = h.store();
    let delayed = NewMessage::builder("conformance", "d-0", "Ordered")
        .partition_key("d")
        .payload(&serde_json::json!({ "key": "d", "n": 0 }))
        .deliver_after(Duration::from_secs(30))
        .build()
        .expect("valid");
    let after = NewMessage::builder("conformance", "d-1", "Ordered")
        .partition_key("d")
        .payload(&serde_json::json!({ "key": "d", "n": 1 }))
        .build()
        .expect("valid");
    h.enqueue(&[delayed, after]).await;
    assert!(
        store
            .claim_ordered(10, Duration::from_secs(60), OnDead::Block)
            .await
            .expect("claim")
            .messages
            .is_empty(),
        "the visible message waits for its delayed predecessor"
    );
}

/// Four concurrent ordered claimers over 30 keys: no key is ever held by two claims at
/// once, and every key's messages are claimed in order, each once.
pub async fn ordered_concurrent_claims_never_share_a_key<H: Harness>(h: &H) {
    let store = h.store();
    let keys: Vec<String> = (0..30).map(|k| format!("key-{k}")).collect();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    h.enqueue(&keyed(&key_refs, 20, "Ordered")).await;
    let mut next = std::collections::HashMap::new();
    let mut total = 0;
    for _round in 0..200 {
        let mut tasks = Vec::new();
        for _ in 0..4 {
            let store = Arc::clone(&store);
            tasks.push(tokio::spawn(async move {
                store
                    .claim_ordered(40, Duration::from_secs(60), OnDead::Block)
                    .await
                    .expect("claim")
                    .messages
            }));
        }
        let mut batches = Vec::new();
        for t in tasks {
            batches.push(t.await.expect("task"));
        }
        let mut owner: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
        for (i, batch) in batches.iter().enumerate() {
            for m in batch {
                let prev = owner.insert(key_of(m), i);
                assert!(
                    prev.is_none_or(|p| p == i),
                    "key {} held by two concurrent claims",
                    key_of(m)
                );
            }
        }
        let mut merged: Vec<OutboxMessage> = batches.into_iter().flatten().collect();
        if merged.is_empty() {
            break;
        }
        merged.sort_by_key(|m| m.seq);
        assert_key_prefixes(&merged, &mut next);
        total += merged.len();
        let done: Vec<Completion> = merged
            .iter()
            .map(|m| completion(m.id, m.claim_token.expect("token"), CompletionOutcome::Sent))
            .collect();
        let report = store.complete(&done).await.expect("complete");
        assert!(report.fenced.is_empty());
    }
    assert_eq!(total, 600, "every message claimed exactly once");
}

/// A claimer that dies holding a run: after the lease the run is reclaimed in order,
/// from its head, one row at a time (each is a suspect: its claim ended without an
/// outcome), and the dead claimer's late completions are fenced.
pub async fn ordered_expired_run_is_reclaimed_in_order<H: Harness>(h: &H) {
    let store = h.store();
    let msgs = keyed(&["x"], 3, "Ordered");
    h.enqueue(&msgs).await;
    let first = store
        .claim_ordered(10, Duration::from_secs(1), OnDead::Block)
        .await
        .expect("claim")
        .messages;
    assert_eq!(first.len(), 3);
    // Another key's fresh messages wait while the suspects go one at a time.
    h.enqueue(&keyed(&["y"], 2, "Ordered")).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut reclaimed = Vec::new();
    for i in 0..3 {
        let batch = store
            .claim_ordered(10, Duration::from_secs(60), OnDead::Block)
            .await
            .expect("claim")
            .messages;
        assert_eq!(batch.len(), 1, "row {i} of the run is reclaimed alone");
        assert_eq!(batch[0].attempts, 2);
        let token = batch[0].claim_token.expect("token");
        let sent = store
            .complete(&[completion(batch[0].id, token, CompletionOutcome::Sent)])
            .await
            .expect("complete");
        assert_eq!(sent.applied, 1);
        reclaimed.push(batch[0].id);
    }
    assert_eq!(
        reclaimed,
        first.iter().map(|m| m.id).collect::<Vec<_>>(),
        "in the key's order"
    );
    let rest = store
        .claim_ordered(10, Duration::from_secs(60), OnDead::Block)
        .await
        .expect("claim")
        .messages;
    assert_eq!(rest.len(), 2, "then the other key's messages, together");
    let stale: Vec<Completion> = first
        .iter()
        .map(|m| completion(m.id, m.claim_token.expect("token"), CompletionOutcome::Sent))
        .collect();
    let report = store.complete(&stale).await.expect("complete");
    assert_eq!(
        report.fenced.len(),
        3,
        "the dead claimer's completion is fenced"
    );
}

/// Expands to one `#[tokio::test]` per conformance property, in a module
/// `store_conformance`. `$harness` is the path of an `async fn() -> impl Harness` that
/// returns a fresh, isolated harness.
///
/// Attributes written before the harness are put on every test, e.g.
/// `store_conformance_tests!(#[ignore = "needs MSSQL_URL"] harness)` for a backend whose
/// server may be absent: without it the tests are reported as ignored (not as passed),
/// and `cargo test -- --ignored` runs them where the server is.
#[macro_export]
macro_rules! store_conformance_tests {
    (@each $attrs:tt $harness:path; $($name:ident),* $(,)?) => {
        $( $crate::store_conformance_tests!(@one $attrs $harness; $name); )*
    };
    (@one [$(#[$attr:meta])*] $harness:path; $name:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        $(#[$attr])*
        async fn $name() {
            let h = $harness().await;
            $crate::conformance::$name(&h).await;
        }
    };
    ($(#[$attr:meta])* $harness:path) => {
        mod store_conformance {
            use super::*;
            $crate::store_conformance_tests!(@each [$(#[$attr])*] $harness;
                claim_marks_processing,
                undecodable_rows_are_poison_alone,
                crash_loop_guard_isolates_and_kills_only_the_crashing_row,
                error_texts_are_stored_sanitized,
                concurrent_claims_are_exclusive,
                completion_applies_each_outcome,
                sent_retention_delete_removes_only_confirmed_rows,
                retry_becomes_claimable_after_backoff,
                expired_lease_is_reclaimed_and_stale_completion_fenced,
                held_rows_wait_for_their_destination_trial,
                ordered_held_row_blocks_its_key,
                dead_letters_and_replay,
                dead_letter_error_filter_is_literal,
                stats_and_purge,
                pending_age_counts_from_when_due,
                ordered_claim_takes_key_prefixes,
                ordered_failing_key_waits_alone,
                ordered_dead_head_blocks_or_skips,
                ordered_delayed_message_holds_its_key,
                ordered_concurrent_claims_never_share_a_key,
                ordered_expired_run_is_reclaimed_in_order,
            );
        }
    };
}
