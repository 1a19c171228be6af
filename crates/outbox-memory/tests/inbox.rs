//! [`MemoryInbox`]: claims commit or roll back with their transaction, concurrent
//! claims of one pair wait for each other, and the optional capabilities.

use std::time::Duration;

use outboxkit_core::wire::IncomingMessage;
use outboxkit_core::{ConsumerDeadLetters, InboxClaim, InboxStore};
use outboxkit_memory::{MemoryInbox, MemoryOutbox};
use uuid::Uuid;

#[tokio::test]
async fn a_claim_commits_or_rolls_back_with_its_transaction() {
    let inbox = MemoryOutbox::new().inbox();
    let id = Uuid::now_v7();

    let mut tx = inbox.begin().await.expect("begin");
    assert!(
        inbox
            .try_claim(&mut tx, id, "projection")
            .await
            .expect("claim")
    );
    assert!(
        !inbox
            .try_claim(&mut tx, id, "projection")
            .await
            .expect("claim"),
        "a duplicate inside the same transaction"
    );
    assert!(
        !inbox.contains(id, "projection"),
        "not visible before commit"
    );
    inbox.rollback(tx).await.expect("rollback");
    assert!(inbox.is_empty(), "the rollback discarded the claim");

    let mut tx = inbox.begin().await.expect("begin");
    assert!(
        inbox
            .try_claim(&mut tx, id, "projection")
            .await
            .expect("claim")
    );
    assert!(
        inbox.try_claim(&mut tx, id, "audit").await.expect("claim"),
        "another consumer claims its own record"
    );
    inbox.commit(tx).await.expect("commit");
    assert!(inbox.contains(id, "projection") && inbox.contains(id, "audit"));

    let mut tx = inbox.begin().await.expect("begin");
    assert!(
        !inbox
            .try_claim(&mut tx, id, "projection")
            .await
            .expect("claim"),
        "a redelivery is a duplicate"
    );
    drop(tx);
}

#[tokio::test(start_paused = true)]
async fn a_second_claim_of_a_pair_waits_for_the_first_transaction() {
    let inbox = MemoryOutbox::new().inbox();
    let id = Uuid::now_v7();
    let mut first = inbox.begin().await.expect("begin");
    assert!(inbox.try_claim(&mut first, id, "c").await.expect("claim"));

    let contender = {
        let inbox = inbox.clone();
        tokio::spawn(async move {
            let mut tx = inbox.begin().await.expect("begin");
            let claimed = inbox.try_claim(&mut tx, id, "c").await.expect("claim");
            inbox.commit(tx).await.expect("commit");
            claimed
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!contender.is_finished(), "it waits on the first one's lock");
    inbox.commit(first).await.expect("commit");
    assert!(
        !contender.await.expect("task"),
        "after the first commits, the second sees a duplicate"
    );

    // A transaction dropped without commit releases its lock and its claim.
    let other = Uuid::now_v7();
    let mut abandoned = inbox.begin().await.expect("begin");
    assert!(
        inbox
            .try_claim(&mut abandoned, other, "c")
            .await
            .expect("claim")
    );
    let contender = {
        let inbox = inbox.clone();
        tokio::spawn(async move {
            let mut tx = inbox.begin().await.expect("begin");
            inbox.try_claim(&mut tx, other, "c").await.expect("claim")
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(abandoned);
    assert!(
        contender.await.expect("task"),
        "claimed once the first is gone"
    );
}

#[tokio::test]
async fn failures_become_consumer_dead_letters_at_the_limit() {
    let inbox = MemoryOutbox::new().inbox();
    let msg = IncomingMessage::new(Uuid::now_v7(), "OrderPlaced", b"{}".to_vec());
    for n in 1..=2 {
        let count = inbox
            .record_failure(&msg, "projection", "boom", 3)
            .await
            .expect("record");
        assert_eq!((count.attempts, count.dead), (n, false));
    }
    let count = inbox
        .record_failure(&msg, "projection", "boom\0", 3)
        .await
        .expect("record");
    assert!(count.dead);
    assert!(inbox.is_dead(msg.id, "projection").await.expect("is_dead"));
    assert!(!inbox.is_dead(msg.id, "audit").await.expect("is_dead"));
    let mut tx = inbox.begin().await.expect("begin");
    assert_eq!(
        inbox
            .claim_unless_dead(&mut tx, msg.id, "projection")
            .await
            .expect("claim"),
        InboxClaim::DeadLetter
    );
    drop(tx);
    let dead = inbox
        .consumer_dead_letters(Some("projection"), 10)
        .await
        .expect("list");
    assert_eq!(dead.len(), 1);
    assert_eq!(
        (dead[0].attempts, dead[0].last_error.as_str()),
        (3, "boom\\0")
    );
    assert_eq!(dead[0].payload, b"{}");
}

/// The store is the one entry point: `migrate` (nothing to create) and `inbox`, whose
/// handles (from any clone of the store) share one set of records.
#[tokio::test]
async fn the_store_gives_the_inbox_and_every_handle_shares_its_records() {
    let outbox = MemoryOutbox::new();
    assert_eq!(outbox.migrate().await.expect("migrate"), Vec::<i32>::new());
    let first: MemoryInbox = outbox.inbox();
    let id = Uuid::now_v7();
    let mut tx = first.begin().await.expect("begin");
    assert!(
        first
            .try_claim(&mut tx, id, "projection")
            .await
            .expect("claim")
    );
    first.commit(tx).await.expect("commit");

    let second = outbox.clone().inbox();
    assert!(
        second.contains(id, "projection"),
        "a clone's inbox sees the record"
    );
    let mut tx = second.begin().await.expect("begin");
    assert!(
        !second
            .try_claim(&mut tx, id, "projection")
            .await
            .expect("claim"),
        "a duplicate through another handle"
    );
    drop(tx);
    assert!(
        MemoryOutbox::new().inbox().is_empty(),
        "another store has its own records"
    );
}
