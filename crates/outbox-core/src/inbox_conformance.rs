//! The inbox conformance suite: the contracts of [`InboxStore`] and of the optional
//! inbox capabilities ([`ConsumerDeadLetters`], [`VersionTracking`], [`DurableInbox`])
//! stated once, run by every backend against itself (enable the `conformance` feature
//! in dev-dependencies).
//!
//! A backend supplies an [`InboxHarness`] (an isolated inbox store, e.g. over a fresh
//! schema) and expands [`inbox_conformance_tests!`](crate::inbox_conformance_tests) with the capabilities it implements:
//!
//! ```ignore
//! async fn harness() -> MyHarness { /* fresh schema */ }
//! outboxkit_core::inbox_conformance_tests!(harness; dead_letters, versions, durable);
//! ```
//!
//! The claim properties of [`InboxStore`] always run; `dead_letters`, `versions` and
//! `durable` add the properties of [`ConsumerDeadLetters`], [`VersionTracking`] and
//! [`DurableInbox`] (a backend without one leaves it out, as the memory backend leaves
//! out `durable`), and `aborts` those of a transaction a failed statement aborted (an
//! [`AbortingHarness`] with [`VersionTracking`]: the SQL backends). Each property panics with a message naming
//! what failed.

use std::sync::Arc;
use std::time::Duration;

use uuid::Uuid;

use crate::inbox::{
    ConsumerDeadLetters, DurableInbox, InboxClaim, InboxCompletion, InboxOutcome, StoredMessage,
    VersionKey, VersionTracking,
};
use crate::store::InboxStore;
use crate::wire::IncomingMessage;

/// What a backend provides to run the inbox suite.
pub trait InboxHarness: Send + Sync + 'static {
    /// The inbox store under test.
    type Inbox: InboxStore;

    /// The inbox store, isolated from every other test (a fresh schema, a fresh
    /// in-memory inbox). Every call returns a handle on the same records.
    fn inbox(&self) -> Arc<Self::Inbox>;
}

/// A backend whose transactions a failed statement can abort (every SQL backend): adds
/// the `aborts` properties, which check that [`InboxStore::commit`] never reports a
/// commit for a transaction that did not commit, and that nothing sent after the abort
/// (a handler's statements, the version the inbox records) commits, on its own or with
/// the commit.
#[async_trait::async_trait]
pub trait AbortingHarness: InboxHarness {
    /// Runs on `conn` (inside a transaction) a statement that fails, and ignores the
    /// error, as a handler that catches a database error and goes on does; the
    /// transaction must then be aborted (PostgreSQL: any failed statement; SQL Server:
    /// one that dooms the transaction or ends it under `XACT_ABORT ON`; MySQL: a
    /// deadlock victim's).
    async fn swallow_a_failed_statement(&self, conn: &mut <Self::Inbox as InboxStore>::Connection);

    /// Sends on `conn` a statement that writes a row of the harness's own table for
    /// `id`, as a handler writes its effect, and returns whether the database took it
    /// (PostgreSQL refuses every statement of an aborted transaction).
    async fn write_effect(
        &self,
        conn: &mut <Self::Inbox as InboxStore>::Connection,
        id: Uuid,
    ) -> bool;

    /// Whether the row [`write_effect`](Self::write_effect) writes for `id` is
    /// committed (read outside any transaction of the test).
    async fn effect_committed(&self, id: Uuid) -> bool;
}

/// Claims `(message_id, consumer)` in a transaction of its own and commits it, returning
/// what the claim answered.
async fn claim_committed<S: InboxStore>(inbox: &S, message_id: Uuid, consumer: &str) -> bool {
    let mut tx = inbox.begin().await.expect("begin");
    let claimed = inbox
        .try_claim(&mut *tx, message_id, consumer)
        .await
        .expect("try_claim");
    inbox.commit(tx).await.expect("commit");
    claimed
}

/// Claims `(message_id, consumer)` in a transaction of its own and rolls it back,
/// returning what the claim answered.
async fn claim_rolled_back<S: InboxStore>(inbox: &S, message_id: Uuid, consumer: &str) -> bool {
    let mut tx = inbox.begin().await.expect("begin");
    let claimed = inbox
        .try_claim(&mut *tx, message_id, consumer)
        .await
        .expect("try_claim");
    inbox.rollback(tx).await.expect("rollback");
    claimed
}

/// A transaction that claimed `(message_id, "projector")` for the first time.
async fn claimed_transaction<S: InboxStore>(inbox: &S, message_id: Uuid) -> S::Transaction {
    let mut tx = inbox.begin().await.expect("begin");
    assert!(
        inbox
            .try_claim(&mut *tx, message_id, "projector")
            .await
            .expect("try_claim"),
        "claimed"
    );
    tx
}

/// Commits `tx`, which a swallowed error aborted: that must be reported.
async fn commit_aborted<S: InboxStore>(inbox: &S, tx: S::Transaction) {
    match inbox.commit(tx).await {
        Err(crate::OutboxError::TransactionAborted { .. }) => {}
        other => {
            panic!("the commit of an aborted transaction must be TransactionAborted, got {other:?}")
        }
    }
}

/// How long a contender is given to show that it waits on a lock (it must still be
/// waiting then). A slow machine can only make the check pass, never fail.
const WAIT_PROBE: Duration = Duration::from_millis(500);

/// Deadline for a contender to finish once the lock it waits on is released.
const FINISH: Duration = Duration::from_secs(30);

/// The first claim of a pair is `true`, a second one (in the same transaction or after
/// the first committed) is `false`; a rolled-back claim leaves nothing behind.
pub async fn claim_commits_or_rolls_back_with_its_transaction<H: InboxHarness>(h: &H) {
    let inbox = h.inbox();
    let id = Uuid::now_v7();

    let mut tx = inbox.begin().await.expect("begin");
    assert!(
        inbox
            .try_claim(&mut *tx, id, "projector")
            .await
            .expect("try_claim"),
        "the first claim of a pair is claimed"
    );
    assert!(
        !inbox
            .try_claim(&mut *tx, id, "projector")
            .await
            .expect("try_claim"),
        "a second claim of the pair in the same transaction is a duplicate"
    );
    inbox.rollback(tx).await.expect("rollback");

    assert!(
        claim_committed(&*inbox, id, "projector").await,
        "a rolled-back claim left nothing behind: the pair is claimable again"
    );
    assert!(
        !claim_committed(&*inbox, id, "projector").await,
        "after the claim committed, a redelivery is a duplicate"
    );
    assert!(
        !claim_rolled_back(&*inbox, id, "projector").await,
        "the committed record stays a duplicate"
    );
}

/// A transaction a failed statement aborted (its error caught and ignored, as a handler
/// may do) is not committed, and its commit says so:
/// [`OutboxError::TransactionAborted`](crate::OutboxError::TransactionAborted), never
/// `Ok`. Its claim left nothing behind.
pub async fn a_commit_after_a_swallowed_error_is_reported_aborted<H: AbortingHarness>(h: &H) {
    let inbox = h.inbox();
    let id = Uuid::now_v7();
    let mut tx = claimed_transaction(&*inbox, id).await;
    h.swallow_a_failed_statement(&mut *tx).await;
    commit_aborted(&*inbox, tx).await;
    assert!(
        claim_committed(&*inbox, id, "projector").await,
        "nothing of the aborted transaction was committed: the pair is claimable again"
    );
}

/// A statement sent after a swallowed abort, as a handler that goes on after catching
/// the error sends it, does not commit: not on its own (in autocommit, as it would on
/// MySQL and SQL Server once the server ended the transaction), nor with the commit,
/// which reports [`OutboxError::TransactionAborted`](crate::OutboxError::TransactionAborted).
/// Nothing of the transaction is left: the redelivery claims the pair and writes the
/// effect once.
pub async fn statements_after_a_swallowed_abort_do_not_commit<H: AbortingHarness>(h: &H) {
    let inbox = h.inbox();
    let id = Uuid::now_v7();
    let mut tx = claimed_transaction(&*inbox, id).await;
    assert!(h.write_effect(&mut *tx, id).await, "the effect is written");
    h.swallow_a_failed_statement(&mut *tx).await;
    let sent_after = h.write_effect(&mut *tx, id).await;
    assert!(
        !h.effect_committed(id).await,
        "a statement sent after the abort (taken: {sent_after}) did not commit on its own"
    );
    commit_aborted(&*inbox, tx).await;
    assert!(
        !h.effect_committed(id).await,
        "nothing sent after the abort was committed by the commit either"
    );

    // The redelivery: the pair is claimable again.
    let mut tx = claimed_transaction(&*inbox, id).await;
    assert!(h.write_effect(&mut *tx, id).await, "the effect is written");
    inbox.commit(tx).await.expect("commit");
    assert!(
        h.effect_committed(id).await,
        "the redelivery's effect commits"
    );
}

/// A version recorded after a swallowed abort ([`VersionTracking::record_version`] and
/// [`record_versions`](VersionTracking::record_versions), which the inbox sends after
/// the handler returned `Ok`) is not committed: the call either fails with
/// [`OutboxError::TransactionAborted`](crate::OutboxError::TransactionAborted) or
/// succeeds and the commit then reports it. Were it committed, the redelivery would
/// find its own version applied and be skipped as stale, its effect lost.
pub async fn versions_recorded_after_a_swallowed_abort_are_not_committed<H>(h: &H)
where
    H: AbortingHarness,
    H::Inbox: VersionTracking,
{
    let inbox = h.inbox();
    let a = VersionKey {
        consumer: "projector",
        aggregate_type: "order",
        aggregate_id: "a",
    };
    let b = VersionKey {
        aggregate_id: "b",
        ..a
    };
    // Version 1 of both applied before.
    let mut tx = inbox.begin().await.expect("begin");
    inbox
        .applied_versions(&mut *tx, &[a, b])
        .await
        .expect("applied_versions");
    inbox
        .record_versions(&mut *tx, &[(a, 1), (b, 1)])
        .await
        .expect("record_versions");
    inbox.commit(tx).await.expect("commit");

    for batch in [false, true] {
        let mut tx = claimed_transaction(&*inbox, Uuid::now_v7()).await;
        assert_eq!(
            inbox
                .applied_versions(&mut *tx, &[a, b])
                .await
                .expect("applied_versions"),
            [Some(1), Some(1)]
        );
        h.swallow_a_failed_statement(&mut *tx).await;
        let recorded = if batch {
            inbox.record_versions(&mut *tx, &[(a, 2), (b, 2)]).await
        } else {
            inbox
                .record_version(&mut *tx, "projector", "order", "a", 2)
                .await
        };
        match recorded {
            Ok(()) => commit_aborted(&*inbox, tx).await,
            Err(crate::OutboxError::TransactionAborted { .. }) => {
                let _ = inbox.rollback(tx).await;
            }
            Err(e) => panic!("recording a version after an abort: {e:?}"),
        }
        let mut tx = inbox.begin().await.expect("begin");
        assert_eq!(
            inbox
                .applied_versions(&mut *tx, &[a, b])
                .await
                .expect("applied_versions"),
            [Some(1), Some(1)],
            "no version recorded after the abort was committed (batch: {batch})"
        );
        inbox.rollback(tx).await.expect("rollback");
    }
}

/// Each consumer has its own record of a message: claiming it for one consumer does not
/// make it a duplicate for another.
pub async fn consumers_claim_a_message_independently<H: InboxHarness>(h: &H) {
    let inbox = h.inbox();
    let id = Uuid::now_v7();
    assert!(
        claim_committed(&*inbox, id, "projector").await,
        "projector claims"
    );
    assert!(
        claim_committed(&*inbox, id, "mailer").await,
        "another consumer claims the same message independently"
    );
    assert!(
        !claim_committed(&*inbox, id, "projector").await,
        "projector's record is still there"
    );
    assert!(
        !claim_committed(&*inbox, id, "mailer").await,
        "mailer's record is there too"
    );
    assert!(
        claim_committed(&*inbox, Uuid::now_v7(), "projector").await,
        "another message of the same consumer is new"
    );
}

/// `try_claim_batch` answers one result per pair, in the order given; a pair repeated in
/// the batch is claimed once, by its first occurrence; pairs already committed are
/// duplicates; an empty batch answers nothing.
pub async fn batch_claims_answer_per_pair_in_order<H: InboxHarness>(h: &H) {
    let inbox = h.inbox();
    let (a, b, c) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    assert!(
        claim_committed(&*inbox, a, "c1").await,
        "a/c1 claimed first"
    );

    // Out of sorted order on purpose: the answer follows the input, not the lock order.
    let pairs = [
        (c, "c1"),
        (a, "c1"),
        (b, "c2"),
        (c, "c1"),
        (b, "c1"),
        (a, "c2"),
    ];
    let mut tx = inbox.begin().await.expect("begin");
    let got = inbox
        .try_claim_batch(&mut *tx, &pairs)
        .await
        .expect("try_claim_batch");
    assert_eq!(
        got,
        [true, false, true, false, true, true],
        "one answer per pair in order: a committed pair is a duplicate, a repeated pair \
         is claimed once by its first occurrence"
    );
    inbox.commit(tx).await.expect("commit");

    let mut tx = inbox.begin().await.expect("begin");
    let again = inbox
        .try_claim_batch(&mut *tx, &pairs)
        .await
        .expect("try_claim_batch");
    assert_eq!(
        again, [false; 6],
        "after the batch committed every pair is a duplicate"
    );
    let empty = inbox
        .try_claim_batch(&mut *tx, &[])
        .await
        .expect("an empty batch");
    assert!(empty.is_empty(), "an empty batch answers nothing");
    inbox.rollback(tx).await.expect("rollback");

    let mut tx = inbox.begin().await.expect("begin");
    let got = inbox
        .try_claim_batch(&mut *tx, &[(b, "c3"), (c, "c3")])
        .await
        .expect("try_claim_batch");
    assert_eq!(got, [true, true], "new pairs in a batch are claimed");
    inbox.rollback(tx).await.expect("rollback");
    assert!(
        claim_committed(&*inbox, b, "c3").await,
        "a rolled-back batch left nothing behind"
    );
}

/// Two transactions claiming one pair: the second waits for the first; when the first
/// commits, the second sees a duplicate.
pub async fn a_concurrent_claim_loses_to_a_committed_one<H: InboxHarness>(h: &H) {
    let inbox = h.inbox();
    let id = Uuid::now_v7();
    let mut first = inbox.begin().await.expect("begin");
    assert!(
        inbox
            .try_claim(&mut *first, id, "c")
            .await
            .expect("try_claim"),
        "the first transaction claims"
    );
    let mut second = {
        let inbox = Arc::clone(&inbox);
        tokio::spawn(async move { claim_committed(&*inbox, id, "c").await })
    };
    assert!(
        tokio::time::timeout(WAIT_PROBE, &mut second).await.is_err(),
        "the second claim of the pair waits while the first transaction holds it"
    );
    inbox.commit(first).await.expect("commit");
    let won = tokio::time::timeout(FINISH, second)
        .await
        .expect("the second claim finishes once the first commits")
        .expect("task");
    assert!(
        !won,
        "once the first commits, the second claim of the pair is a duplicate"
    );
}

/// Two transactions claiming one pair: when the first rolls back, the waiting second
/// claims it (a claim is never lost to a rolled-back one).
pub async fn a_concurrent_claim_wins_over_a_rolled_back_one<H: InboxHarness>(h: &H) {
    let inbox = h.inbox();
    let id = Uuid::now_v7();
    let mut first = inbox.begin().await.expect("begin");
    assert!(
        inbox
            .try_claim(&mut *first, id, "c")
            .await
            .expect("try_claim"),
        "the first transaction claims"
    );
    let second = {
        let inbox = Arc::clone(&inbox);
        tokio::spawn(async move { claim_committed(&*inbox, id, "c").await })
    };
    // Give the second claim a moment to start waiting (it must win either way).
    tokio::time::sleep(Duration::from_millis(100)).await;
    inbox.rollback(first).await.expect("rollback");
    let won = tokio::time::timeout(FINISH, second)
        .await
        .expect("the second claim finishes once the first rolls back")
        .expect("task");
    assert!(won, "a claim waiting on a rolled-back one wins");
    assert!(
        !claim_committed(&*inbox, id, "c").await,
        "and its record committed"
    );
}

/// Many transactions racing to claim and commit one pair: exactly one wins, every time.
pub async fn racing_claims_let_exactly_one_commit<H: InboxHarness>(h: &H) {
    let inbox = h.inbox();
    for round in 0..20 {
        let id = Uuid::now_v7();
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let inbox = Arc::clone(&inbox);
                tokio::spawn(async move { claim_committed(&*inbox, id, "c").await })
            })
            .collect();
        let mut winners = 0;
        for task in tasks {
            let won = tokio::time::timeout(FINISH, task)
                .await
                .expect("every racing claim finishes")
                .expect("task");
            winners += usize::from(won);
        }
        assert_eq!(
            winners, 1,
            "round {round}: exactly one of four racing claims wins"
        );
    }
}

/// `purge` deletes committed records older than the age given, at most `batch_size` per
/// call, and returns how many; recent records are kept (a large age purges none); a
/// purged pair is claimable again.
pub async fn purge_removes_only_old_records_in_batches<H: InboxHarness>(h: &H) {
    let inbox = h.inbox();
    let ids: Vec<Uuid> = (0..5).map(|_| Uuid::now_v7()).collect();
    let mut tx = inbox.begin().await.expect("begin");
    for id in &ids {
        assert!(
            inbox
                .try_claim(&mut *tx, *id, "c")
                .await
                .expect("try_claim"),
            "claim {id}"
        );
    }
    inbox.commit(tx).await.expect("commit");

    assert_eq!(
        inbox
            .purge(Duration::from_secs(3600), 100)
            .await
            .expect("purge"),
        0,
        "records younger than the age are kept"
    );
    for id in &ids {
        assert!(
            !claim_rolled_back(&*inbox, *id, "c").await,
            "a record younger than the age is still a duplicate after purge"
        );
    }
    assert_eq!(
        inbox.purge(Duration::ZERO, 3).await.expect("purge"),
        3,
        "purge removes at most batch_size records"
    );
    assert_eq!(
        inbox.purge(Duration::ZERO, 100).await.expect("purge"),
        2,
        "the rest go on the next call"
    );
    assert_eq!(
        inbox.purge(Duration::ZERO, 100).await.expect("purge"),
        0,
        "nothing is left to purge"
    );
    for id in &ids {
        assert!(
            claim_rolled_back(&*inbox, *id, "c").await,
            "a purged pair is claimable again"
        );
    }
}

/// A test message with an aggregate, a header and a payload.
fn message(event_type: &str, n: usize) -> IncomingMessage {
    let mut msg = IncomingMessage::new(
        Uuid::now_v7(),
        event_type,
        format!("{{\"n\":{n}}}").into_bytes(),
    );
    msg.aggregate_type = Some("order".into());
    msg.aggregate_id = Some(format!("agg-{n}"));
    msg.aggregate_version = Some(i64::try_from(n).unwrap_or(i64::MAX));
    msg.headers.insert("k".into(), format!("v{n}"));
    msg
}

/// A message as another producer may send it: a NUL character in its event type,
/// aggregate id, a header name and value, which our builder refuses and PostgreSQL's
/// `text` and `jsonb` cannot hold.
fn message_with_nul_characters(n: usize) -> IncomingMessage {
    let mut msg = message("Order\0Placed", n);
    msg.aggregate_id = Some(format!("agg\0{n}"));
    msg.headers.insert("no\0te".into(), "be\0fore".into());
    msg
}

/// `record_failure` counts failures per `(message, consumer)` and reports the message
/// dead once the count reaches `max_attempts`; `is_dead` says so for that consumer only;
/// `consumer_dead_letters` lists dead letters oldest first, with payload, event type,
/// error and count, filtered by consumer and capped by `limit`.
pub async fn failures_become_consumer_dead_letters_at_the_limit<H>(h: &H)
where
    H: InboxHarness,
    H::Inbox: ConsumerDeadLetters,
{
    let inbox = h.inbox();
    let first = message("OrderPlaced", 1);
    for attempt in 1..=3 {
        assert!(
            !inbox.is_dead(first.id, "projector").await.expect("is_dead"),
            "not dead before failure {attempt}"
        );
        let count = inbox
            .record_failure(&first, "projector", &format!("boom {attempt}"), 3)
            .await
            .expect("record_failure");
        assert_eq!(
            count.attempts, attempt,
            "failure {attempt} is counted as attempt {attempt}"
        );
        assert_eq!(
            count.dead,
            attempt == 3,
            "dead exactly when attempts reach max_attempts (attempt {attempt} of 3)"
        );
    }
    assert!(
        inbox.is_dead(first.id, "projector").await.expect("is_dead"),
        "is_dead after max_attempts failures"
    );
    assert!(
        !inbox.is_dead(first.id, "mailer").await.expect("is_dead"),
        "a dead letter is one consumer's"
    );
    let count = inbox
        .record_failure(&first, "mailer", "once", 1)
        .await
        .expect("record_failure");
    assert_eq!(
        (count.attempts, count.dead),
        (1, true),
        "max_attempts 1: the first failure is the dead letter"
    );

    let second = message("OrderShipped", 2);
    let count = inbox
        .record_failure(&second, "projector", "later", 1)
        .await
        .expect("record_failure");
    assert!(count.dead, "the second message is dead at once");

    let listed = inbox
        .consumer_dead_letters(Some("projector"), 10)
        .await
        .expect("consumer_dead_letters");
    let ids: Vec<Uuid> = listed.iter().map(|d| d.message_id).collect();
    assert_eq!(
        ids,
        [first.id, second.id],
        "projector's dead letters, oldest first, without mailer's"
    );
    let d = &listed[0];
    assert_eq!(
        d.consumer, "projector",
        "the dead letter names its consumer"
    );
    assert_eq!(d.event_type, "OrderPlaced", "the event type is kept");
    assert_eq!(d.payload, first.payload, "the payload is kept as received");
    assert_eq!(d.attempts, 3, "the failures counted are kept");
    assert_eq!(d.last_error, "boom 3", "the last error is kept");

    let all = inbox
        .consumer_dead_letters(None, 10)
        .await
        .expect("consumer_dead_letters");
    assert_eq!(
        all.len(),
        3,
        "without a consumer every dead letter is listed"
    );
    let capped = inbox
        .consumer_dead_letters(None, 2)
        .await
        .expect("consumer_dead_letters");
    assert_eq!(capped.len(), 2, "limit caps the listing");
    assert!(
        inbox
            .consumer_dead_letters(Some("nobody"), 10)
            .await
            .expect("consumer_dead_letters")
            .is_empty(),
        "a consumer without dead letters lists none"
    );
}

/// A message with NUL characters (another producer's) can be dead-lettered: a store
/// that cannot hold a NUL writes it escaped (PostgreSQL: `\0`) rather than failing, so
/// the consumer never defers such a message forever.
pub async fn a_message_with_nul_characters_can_be_dead_lettered<H>(h: &H)
where
    H: InboxHarness,
    H::Inbox: ConsumerDeadLetters,
{
    let inbox = h.inbox();
    let odd = message_with_nul_characters(1);
    let count = inbox
        .record_failure(&odd, "projector", "bo\0om", 1)
        .await
        .expect("record_failure of a message with NUL characters");
    assert!(count.dead, "dead at the limit");
    assert!(inbox.is_dead(odd.id, "projector").await.expect("is_dead"));
    let listed = inbox
        .consumer_dead_letters(Some("projector"), 10)
        .await
        .expect("consumer_dead_letters");
    assert_eq!(listed.len(), 1, "the dead letter is listed");
    assert_eq!(
        listed[0].payload, odd.payload,
        "the payload is kept as received"
    );
}

/// `claim_unless_dead` answers `DeadLetter` for a dead letter of that consumer and
/// writes nothing; otherwise it claims as `try_claim` does (`Claimed`, then
/// `Duplicate`); the batch form answers per pair in order, a repeated pair claimed once.
pub async fn claim_unless_dead_refuses_dead_letters<H>(h: &H)
where
    H: InboxHarness,
    H::Inbox: ConsumerDeadLetters,
{
    let inbox = h.inbox();
    let dead = message("OrderPlaced", 1);
    let live = Uuid::now_v7();
    let count = inbox
        .record_failure(&dead, "projector", "poison", 1)
        .await
        .expect("record_failure");
    assert!(count.dead, "max_attempts 1 makes a dead letter at once");

    let mut tx = inbox.begin().await.expect("begin");
    assert_eq!(
        inbox
            .claim_unless_dead(&mut *tx, dead.id, "projector")
            .await
            .expect("claim_unless_dead"),
        InboxClaim::DeadLetter,
        "a consumer dead letter is refused"
    );
    assert_eq!(
        inbox
            .claim_unless_dead(&mut *tx, dead.id, "mailer")
            .await
            .expect("claim_unless_dead"),
        InboxClaim::Claimed,
        "another consumer of the dead message claims it"
    );
    assert_eq!(
        inbox
            .claim_unless_dead(&mut *tx, live, "projector")
            .await
            .expect("claim_unless_dead"),
        InboxClaim::Claimed,
        "a live message is claimed"
    );
    inbox.commit(tx).await.expect("commit");

    let mut tx = inbox.begin().await.expect("begin");
    assert_eq!(
        inbox
            .claim_unless_dead(&mut *tx, live, "projector")
            .await
            .expect("claim_unless_dead"),
        InboxClaim::Duplicate,
        "a committed claim makes the redelivery a duplicate"
    );
    inbox.rollback(tx).await.expect("rollback");

    let fresh = Uuid::now_v7();
    let pairs = [
        (fresh, "projector"),
        (dead.id, "projector"),
        (live, "projector"),
        (fresh, "projector"),
        (dead.id, "projector"),
    ];
    let mut tx = inbox.begin().await.expect("begin");
    let got = inbox
        .claim_batch_unless_dead(&mut *tx, &pairs)
        .await
        .expect("claim_batch_unless_dead");
    assert_eq!(
        got,
        [
            InboxClaim::Claimed,
            InboxClaim::DeadLetter,
            InboxClaim::Duplicate,
            InboxClaim::Duplicate,
            InboxClaim::DeadLetter,
        ],
        "one answer per pair in order: new claimed once, dead refused each time, \
         committed a duplicate"
    );
    inbox.rollback(tx).await.expect("rollback");

    assert!(
        claim_rolled_back(&*inbox, dead.id, "projector").await,
        "refusing a dead letter wrote no inbox record"
    );
}

/// Version keys with NUL characters (another producer's aggregate ids) are tracked like
/// any other: recorded, read back, kept apart from the same id without the NUL.
pub async fn versions_of_an_aggregate_id_with_nul_characters_are_tracked<H>(h: &H)
where
    H: InboxHarness,
    H::Inbox: VersionTracking,
{
    let inbox = h.inbox();
    let mut tx = inbox.begin().await.expect("begin");
    assert_eq!(
        inbox
            .applied_version(&mut *tx, "projector", "ord\0er", "a\0b")
            .await
            .expect("applied_version with NUL characters"),
        None,
        "nothing applied yet"
    );
    inbox
        .record_version(&mut *tx, "projector", "ord\0er", "a\0b", 7)
        .await
        .expect("record_version with NUL characters");
    inbox.commit(tx).await.expect("commit");
    let mut tx = inbox.begin().await.expect("begin");
    let single = inbox
        .applied_version(&mut *tx, "projector", "ord\0er", "a\0b")
        .await
        .expect("applied_version with NUL characters");
    let batch = inbox
        .applied_versions(
            &mut *tx,
            &[
                VersionKey {
                    consumer: "projector",
                    aggregate_type: "ord\0er",
                    aggregate_id: "a\0b",
                },
                VersionKey {
                    consumer: "projector",
                    aggregate_type: "order",
                    aggregate_id: "ab",
                },
            ],
        )
        .await
        .expect("applied_versions with NUL characters");
    inbox.rollback(tx).await.expect("rollback");
    assert_eq!(single, Some(7), "read back");
    assert_eq!(
        batch,
        [Some(7), None],
        "read back in a batch, apart from `ab`"
    );
}

/// The last applied version per `(consumer, aggregate)`: `None` before any, only ever
/// raised (a lower version recorded later does not lower it), committed or rolled back
/// with the transaction, read back by the transaction that recorded it, and kept apart
/// per consumer and per aggregate.
pub async fn versions_only_rise_and_commit_with_the_transaction<H>(h: &H)
where
    H: InboxHarness,
    H::Inbox: VersionTracking,
{
    let inbox = h.inbox();
    let mut tx = inbox.begin().await.expect("begin");
    assert_eq!(
        inbox
            .applied_version(&mut *tx, "projector", "order", "1")
            .await
            .expect("applied_version"),
        None,
        "nothing applied yet"
    );
    inbox
        .record_version(&mut *tx, "projector", "order", "1", 3)
        .await
        .expect("record_version");
    inbox
        .record_version(&mut *tx, "projector", "order", "1", 2)
        .await
        .expect("record_version");
    assert_eq!(
        inbox
            .applied_version(&mut *tx, "projector", "order", "1")
            .await
            .expect("applied_version"),
        Some(3),
        "the transaction reads its own version, never lowered by a later lower one"
    );
    inbox.rollback(tx).await.expect("rollback");

    let mut tx = inbox.begin().await.expect("begin");
    assert_eq!(
        inbox
            .applied_version(&mut *tx, "projector", "order", "1")
            .await
            .expect("applied_version"),
        None,
        "a rolled-back version is gone"
    );
    inbox
        .record_version(&mut *tx, "projector", "order", "1", 5)
        .await
        .expect("record_version");
    inbox.commit(tx).await.expect("commit");

    let mut tx = inbox.begin().await.expect("begin");
    inbox
        .record_version(&mut *tx, "projector", "order", "1", 4)
        .await
        .expect("record_version");
    inbox.commit(tx).await.expect("commit");

    let mut tx = inbox.begin().await.expect("begin");
    assert_eq!(
        inbox
            .applied_version(&mut *tx, "projector", "order", "1")
            .await
            .expect("applied_version"),
        Some(5),
        "a stale version committed later does not lower the applied one"
    );
    assert_eq!(
        inbox
            .applied_version(&mut *tx, "mailer", "order", "1")
            .await
            .expect("applied_version"),
        None,
        "versions are per consumer"
    );
    assert_eq!(
        inbox
            .applied_version(&mut *tx, "projector", "order", "2")
            .await
            .expect("applied_version"),
        None,
        "versions are per aggregate id"
    );
    assert_eq!(
        inbox
            .applied_version(&mut *tx, "projector", "invoice", "1")
            .await
            .expect("applied_version"),
        None,
        "versions are per aggregate type"
    );
    inbox.rollback(tx).await.expect("rollback");
}

/// The batch forms: `applied_versions` answers one version per key in order (a repeated
/// key the same each time); `record_versions` raises each key to the largest version
/// given for it (read back by the same transaction) and never lowers a stored one; a
/// rolled-back batch leaves nothing.
pub async fn batch_versions_answer_per_key_and_keep_the_largest<H>(h: &H)
where
    H: InboxHarness,
    H::Inbox: VersionTracking,
{
    let inbox = h.inbox();
    let k1 = VersionKey {
        consumer: "projector",
        aggregate_type: "order",
        aggregate_id: "2",
    };
    let k2 = VersionKey {
        aggregate_id: "10",
        ..k1
    };
    let k3 = VersionKey {
        consumer: "mailer",
        ..k1
    };
    let mut tx = inbox.begin().await.expect("begin");
    assert_eq!(
        inbox
            .applied_versions(&mut *tx, &[k1, k2, k1])
            .await
            .expect("applied_versions"),
        [None, None, None],
        "nothing applied yet, one answer per key"
    );
    inbox
        .record_versions(&mut *tx, &[(k1, 3), (k2, 1), (k1, 7), (k1, 2)])
        .await
        .expect("record_versions");
    assert_eq!(
        inbox
            .applied_versions(&mut *tx, &[k1, k2])
            .await
            .expect("applied_versions"),
        [Some(7), Some(1)],
        "the transaction reads the versions it recorded, the largest per key"
    );
    inbox.commit(tx).await.expect("commit");

    let mut tx = inbox.begin().await.expect("begin");
    inbox
        .record_versions(&mut *tx, &[(k1, 4), (k2, 2)])
        .await
        .expect("record_versions");
    inbox.commit(tx).await.expect("commit");

    let mut tx = inbox.begin().await.expect("begin");
    assert_eq!(
        inbox
            .applied_versions(&mut *tx, &[k2, k1, k3, k2])
            .await
            .expect("applied_versions"),
        [Some(2), Some(7), None, Some(2)],
        "the largest version per key, never lowered by a stale batch, in input order"
    );
    inbox
        .record_versions(&mut *tx, &[(k3, 9)])
        .await
        .expect("record_versions");
    inbox.rollback(tx).await.expect("rollback");

    let mut tx = inbox.begin().await.expect("begin");
    assert_eq!(
        inbox
            .applied_versions(&mut *tx, &[k3])
            .await
            .expect("applied_versions"),
        [None],
        "a rolled-back batch of versions is gone"
    );
    inbox.rollback(tx).await.expect("rollback");
}

/// `applied_version` locks the aggregate's record until the transaction ends: a second
/// transaction reading it waits, and then sees the version the first committed (so two
/// messages of one aggregate are applied one after the other, and the later one can
/// tell it is stale or out of order).
pub async fn applied_version_orders_two_messages_of_one_aggregate<H>(h: &H)
where
    H: InboxHarness,
    H::Inbox: VersionTracking,
{
    let inbox = h.inbox();
    let mut first = inbox.begin().await.expect("begin");
    assert_eq!(
        inbox
            .applied_version(&mut *first, "projector", "order", "1")
            .await
            .expect("applied_version"),
        None,
        "nothing applied yet"
    );
    let mut second = {
        let inbox = Arc::clone(&inbox);
        tokio::spawn(async move {
            let mut tx = inbox.begin().await.expect("begin");
            let seen = inbox
                .applied_version(&mut *tx, "projector", "order", "1")
                .await
                .expect("applied_version");
            inbox.rollback(tx).await.expect("rollback");
            seen
        })
    };
    assert!(
        tokio::time::timeout(WAIT_PROBE, &mut second).await.is_err(),
        "a second transaction reading the aggregate's version waits for the first"
    );
    inbox
        .record_version(&mut *first, "projector", "order", "1", 1)
        .await
        .expect("record_version");
    inbox.commit(first).await.expect("commit");
    let seen = tokio::time::timeout(FINISH, second)
        .await
        .expect("the second read finishes once the first commits")
        .expect("task");
    assert_eq!(
        seen,
        Some(1),
        "the second transaction sees the version the first committed"
    );
}

/// Claims stored messages until `want` are claimed or a deadline passes.
async fn claim_stored<S: DurableInbox>(
    inbox: &S,
    batch: usize,
    lease: Duration,
    want: usize,
) -> Vec<StoredMessage> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let got = inbox.claim(batch, lease).await.expect("durable claim");
        if got.len() >= want || tokio::time::Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn done(m: &StoredMessage) -> InboxCompletion {
    InboxCompletion {
        id: m.message.id,
        claim_token: m.claim_token,
        outcome: InboxOutcome::Done,
    }
}

/// `store` keeps a message once (a redelivery answers `false`); `store_batch` answers
/// per message in order, a repeated id stored once by its first occurrence; the stored
/// messages come back from `claim` oldest first with their fields intact.
pub async fn durable_store_keeps_each_message_once<H>(h: &H)
where
    H: InboxHarness,
    H::Inbox: DurableInbox,
{
    let inbox = h.inbox();
    let m1 = message("OrderPlaced", 1);
    let m2 = message("OrderPlaced", 2);
    let m3 = message("OrderPlaced", 3);
    assert!(inbox.store(&m1).await.expect("store"), "a new message");
    assert!(
        !inbox.store(&m1).await.expect("store"),
        "a redelivered message is stored once"
    );
    let got = inbox
        .store_batch(&[m3.clone(), m1.clone(), m2.clone(), m3.clone()])
        .await
        .expect("store_batch");
    assert_eq!(
        got,
        [true, false, true, false],
        "one answer per message in order: stored once, a repeat or a stored one is not new"
    );
    assert!(
        inbox
            .store_batch(&[])
            .await
            .expect("an empty batch")
            .is_empty(),
        "an empty batch answers nothing"
    );

    let claimed = claim_stored(&*inbox, 10, Duration::from_secs(60), 3).await;
    let ids: Vec<Uuid> = claimed.iter().map(|m| m.message.id).collect();
    assert_eq!(ids.len(), 3, "three distinct messages are stored: {ids:?}");
    assert_eq!(ids[0], m1.id, "the first stored comes first");
    let mut rest = ids[1..].to_vec();
    rest.sort();
    assert_eq!(rest, [m2.id, m3.id], "then the batch's messages");
    let first = &claimed[0].message;
    assert_eq!(first.event_type, m1.event_type, "event type round-trips");
    assert_eq!(first.payload, m1.payload, "payload round-trips");
    assert_eq!(
        first.aggregate_id, m1.aggregate_id,
        "aggregate id round-trips"
    );
    assert_eq!(
        first.aggregate_version, m1.aggregate_version,
        "aggregate version round-trips"
    );
    assert_eq!(first.headers, m1.headers, "headers round-trip");
}

/// A message with NUL characters (another producer's) is stored, alone and in a batch,
/// and claimed back: a store that cannot hold a NUL writes it escaped (PostgreSQL:
/// `\0`) rather than failing, so the consumer never defers it, and the deliveries
/// behind it, forever.
pub async fn durable_store_takes_a_message_with_nul_characters<H>(h: &H)
where
    H: InboxHarness,
    H::Inbox: DurableInbox,
{
    let inbox = h.inbox();
    let (alone, batched, plain) = (
        message_with_nul_characters(1),
        message_with_nul_characters(2),
        message("OrderPlaced", 3),
    );
    assert!(
        inbox
            .store(&alone)
            .await
            .expect("store with NUL characters")
    );
    assert_eq!(
        inbox
            .store_batch(&[batched.clone(), plain.clone()])
            .await
            .expect("store_batch with NUL characters"),
        [true, true]
    );
    let claimed = claim_stored(&*inbox, 10, Duration::from_secs(60), 3).await;
    let mut ids: Vec<Uuid> = claimed.iter().map(|m| m.message.id).collect();
    ids.sort();
    let mut want = vec![alone.id, batched.id, plain.id];
    want.sort();
    assert_eq!(ids, want, "all three are claimed back");
}

/// `claim` leases stored messages with a fresh token and `attempts + 1`; leased messages
/// are not claimed again; a completion with a wrong token, or after the message was
/// completed, is fenced; an expired lease is reclaimed with a new token and the old
/// claimer's completion is fenced.
pub async fn durable_claims_are_leased_and_completions_fenced<H>(h: &H)
where
    H: InboxHarness,
    H::Inbox: DurableInbox,
{
    let inbox = h.inbox();
    let m1 = message("OrderPlaced", 1);
    let m2 = message("OrderPlaced", 2);
    inbox
        .store_batch(&[m1.clone(), m2.clone()])
        .await
        .expect("store_batch");

    let claimed = claim_stored(&*inbox, 1, Duration::from_secs(60), 1).await;
    assert_eq!(claimed.len(), 1, "batch_size caps the claim");
    assert_eq!(claimed[0].message.id, m1.id, "oldest first");
    assert_eq!(claimed[0].attempts, 1, "the first claim counts one attempt");
    let leased = claimed[0].clone();

    let short = claim_stored(&*inbox, 10, Duration::from_millis(300), 1).await;
    let ids: Vec<Uuid> = short.iter().map(|m| m.message.id).collect();
    assert_eq!(
        ids,
        [m2.id],
        "a leased message is not claimed again while its lease holds"
    );
    assert_ne!(
        short[0].claim_token, leased.claim_token,
        "each claim has a fresh token"
    );

    let stale = InboxCompletion {
        claim_token: Uuid::new_v4(),
        ..done(&leased)
    };
    let report = inbox.complete(&[stale]).await.expect("complete");
    assert_eq!(
        (report.applied, report.fenced.as_slice()),
        (0, [m1.id].as_slice()),
        "a completion with a wrong token is fenced"
    );
    let report = inbox.complete(&[done(&leased)]).await.expect("complete");
    assert_eq!(
        (report.applied, report.fenced.len()),
        (1, 0),
        "the claimer's completion applies"
    );
    let report = inbox.complete(&[done(&leased)]).await.expect("complete");
    assert_eq!(
        report.fenced,
        [m1.id],
        "completing an already completed message is fenced"
    );

    // m2's 300 ms lease expires: it is claimed again, with a new token.
    let again = claim_stored(&*inbox, 10, Duration::from_secs(60), 1).await;
    let ids: Vec<Uuid> = again.iter().map(|m| m.message.id).collect();
    assert_eq!(
        ids,
        [m2.id],
        "an expired lease is reclaimed (and Done is not)"
    );
    assert_eq!(again[0].attempts, 2, "the reclaim counts a second attempt");
    assert_ne!(
        again[0].claim_token, short[0].claim_token,
        "the reclaim has a new token"
    );
    let report = inbox.complete(&[done(&short[0])]).await.expect("complete");
    assert_eq!(
        report.fenced,
        [m2.id],
        "the expired claimer's completion is fenced"
    );
    let report = inbox.complete(&[done(&again[0])]).await.expect("complete");
    assert_eq!(report.applied, 1, "the new claimer's completion applies");
}

/// Each outcome: `Retry` makes the message claimable again after its delay (charging
/// the attempt), `Defer` likewise without charging it, `Dead` and `Done` end it.
pub async fn durable_outcomes_retry_defer_and_end<H>(h: &H)
where
    H: InboxHarness,
    H::Inbox: DurableInbox,
{
    let inbox = h.inbox();
    let msgs: Vec<IncomingMessage> = (0..4).map(|n| message("Outcome", n)).collect();
    inbox.store_batch(&msgs).await.expect("store_batch");
    let claimed = claim_stored(&*inbox, 10, Duration::from_secs(60), 4).await;
    assert_eq!(claimed.len(), 4, "all four stored messages are claimed");
    let completion = |i: usize, outcome: InboxOutcome| InboxCompletion {
        outcome,
        ..done(&claimed[i])
    };
    let report = inbox
        .complete(&[
            completion(0, InboxOutcome::Done),
            completion(
                1,
                InboxOutcome::Retry {
                    delay: Duration::ZERO,
                    error: "try again".into(),
                },
            ),
            completion(
                2,
                InboxOutcome::Dead {
                    error: "give up".into(),
                },
            ),
            completion(
                3,
                InboxOutcome::Defer {
                    delay: Duration::ZERO,
                },
            ),
        ])
        .await
        .expect("complete");
    assert_eq!(
        (report.applied, report.fenced.len()),
        (4, 0),
        "four completions in one call apply"
    );

    let again = claim_stored(&*inbox, 10, Duration::from_secs(60), 2).await;
    let mut by_id: Vec<(Uuid, i32)> = again.iter().map(|m| (m.message.id, m.attempts)).collect();
    by_id.sort();
    let mut want = vec![(claimed[1].message.id, 2), (claimed[3].message.id, 1)];
    want.sort();
    assert_eq!(
        by_id, want,
        "Retry comes back with a second attempt, Defer without charging one; Done and \
         Dead are not claimed again"
    );

    let later: Vec<InboxCompletion> = again
        .iter()
        .map(|m| InboxCompletion {
            outcome: InboxOutcome::Retry {
                delay: Duration::from_secs(3600),
                error: "much later".into(),
            },
            ..done(m)
        })
        .collect();
    assert_eq!(
        inbox.complete(&later).await.expect("complete").applied,
        2,
        "retries with a long delay apply"
    );
    assert!(
        inbox
            .claim(10, Duration::from_secs(60))
            .await
            .expect("durable claim")
            .is_empty(),
        "a retry is not claimable before its delay"
    );
}

/// `purge_processed` deletes Done messages processed longer ago than the age given (at
/// most `batch_size` per call), never pending or dead ones.
pub async fn durable_purge_processed_removes_only_old_done_messages<H>(h: &H)
where
    H: InboxHarness,
    H::Inbox: DurableInbox,
{
    let inbox = h.inbox();
    let msgs: Vec<IncomingMessage> = (0..5).map(|n| message("Purge", n)).collect();
    inbox.store_batch(&msgs).await.expect("store_batch");
    let claimed = claim_stored(&*inbox, 4, Duration::from_secs(60), 4).await;
    assert_eq!(claimed.len(), 4, "four of five are claimed");
    let report = inbox
        .complete(&[
            done(&claimed[0]),
            done(&claimed[1]),
            done(&claimed[2]),
            InboxCompletion {
                outcome: InboxOutcome::Dead {
                    error: "dead".into(),
                },
                ..done(&claimed[3])
            },
        ])
        .await
        .expect("complete");
    assert_eq!(report.applied, 4, "the completions apply");

    assert_eq!(
        inbox
            .purge_processed(Duration::from_secs(3600), 100)
            .await
            .expect("purge_processed"),
        0,
        "recently processed messages are kept"
    );
    assert_eq!(
        inbox
            .purge_processed(Duration::ZERO, 2)
            .await
            .expect("purge_processed"),
        2,
        "purge_processed removes at most batch_size"
    );
    assert_eq!(
        inbox
            .purge_processed(Duration::ZERO, 100)
            .await
            .expect("purge_processed"),
        1,
        "only Done messages go: the dead and the pending one stay"
    );
    let never_claimed: Vec<Uuid> = msgs
        .iter()
        .map(|m| m.id)
        .filter(|id| claimed.iter().all(|c| c.message.id != *id))
        .collect();
    let pending = claim_stored(&*inbox, 10, Duration::from_secs(60), 1).await;
    let ids: Vec<Uuid> = pending.iter().map(|m| m.message.id).collect();
    assert_eq!(
        ids, never_claimed,
        "the never-claimed message is still stored"
    );
    assert!(
        !inbox.store(&claimed[3].message).await.expect("store"),
        "the dead message is still stored (a redelivery is not new)"
    );
}

/// Expands to one `#[tokio::test]` per inbox conformance property, in a module
/// `inbox_conformance`.
///
/// `inbox_conformance_tests!($harness; caps...)`: `$harness` is the path of an
/// `async fn() -> impl InboxHarness` returning a fresh, isolated harness. The claim
/// properties of [`InboxStore`](crate::InboxStore) always run; each capability named
/// after the `;` adds its properties: `dead_letters`
/// ([`ConsumerDeadLetters`](crate::ConsumerDeadLetters)), `versions`
/// ([`VersionTracking`](crate::VersionTracking)), `durable`
/// ([`DurableInbox`](crate::inbox::DurableInbox)), `aborts` (an [`AbortingHarness`]
/// whose inbox tracks versions).
///
/// Attributes written before the harness are put on every test, e.g.
/// `inbox_conformance_tests!(#[ignore = "needs MSSQL_URL"] harness; caps...)` for a
/// backend whose server may be absent: without it the tests are reported as ignored (not
/// as passed), and `cargo test -- --ignored` runs them where the server is.
#[macro_export]
macro_rules! inbox_conformance_tests {
    (@cap $mode:tt; claims) => {
        $crate::inbox_conformance_tests!(@each $mode;
            claim_commits_or_rolls_back_with_its_transaction,
            consumers_claim_a_message_independently,
            batch_claims_answer_per_pair_in_order,
            a_concurrent_claim_loses_to_a_committed_one,
            a_concurrent_claim_wins_over_a_rolled_back_one,
            racing_claims_let_exactly_one_commit,
            purge_removes_only_old_records_in_batches,
        );
    };
    (@cap $mode:tt; dead_letters) => {
        $crate::inbox_conformance_tests!(@each $mode;
            failures_become_consumer_dead_letters_at_the_limit,
            a_message_with_nul_characters_can_be_dead_lettered,
            claim_unless_dead_refuses_dead_letters,
        );
    };
    (@cap $mode:tt; versions) => {
        $crate::inbox_conformance_tests!(@each $mode;
            versions_only_rise_and_commit_with_the_transaction,
            batch_versions_answer_per_key_and_keep_the_largest,
            applied_version_orders_two_messages_of_one_aggregate,
            versions_of_an_aggregate_id_with_nul_characters_are_tracked,
        );
    };
    (@cap $mode:tt; aborts) => {
        $crate::inbox_conformance_tests!(@each $mode;
            a_commit_after_a_swallowed_error_is_reported_aborted,
            statements_after_a_swallowed_abort_do_not_commit,
            versions_recorded_after_a_swallowed_abort_are_not_committed,
        );
    };
    (@cap $mode:tt; durable) => {
        $crate::inbox_conformance_tests!(@each $mode;
            durable_store_keeps_each_message_once,
            durable_store_takes_a_message_with_nul_characters,
            durable_claims_are_leased_and_completions_fenced,
            durable_outcomes_retry_defer_and_end,
            durable_purge_processed_removes_only_old_done_messages,
        );
    };
    (@each $mode:tt; $($name:ident),* $(,)?) => {
        $( $crate::inbox_conformance_tests!(@one $mode; $name); )*
    };
    (@one ([$(#[$attr:meta])*] $harness:path); $name:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        $(#[$attr])*
        async fn $name() {
            let h = $harness().await;
            $crate::inbox_conformance::$name(&h).await;
        }
    };
    (@caps $mode:tt; $($cap:ident),*) => {
        $( $crate::inbox_conformance_tests!(@cap $mode; $cap); )*
    };
    ($(#[$attr:meta])* $harness:path $(; $($cap:ident),* $(,)?)?) => {
        mod inbox_conformance {
            use super::*;
            $crate::inbox_conformance_tests!(@caps ([$(#[$attr])*] $harness); claims $($(, $cap)*)?);
        }
    };
}
