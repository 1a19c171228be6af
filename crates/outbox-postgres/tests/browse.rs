//! The browsing queries of `OutboxAdmin` (the dashboard's): keyset-paged listings of
//! each state, bounded counts, sent per minute.

mod common;

use std::collections::BTreeSet;

use common::{enqueue_committed, fresh_outbox};
use outbox_core::{MessageFilter, MessageState, NewMessage, OutboxAdmin as _};
use uuid::Uuid;

fn event(n: i64, event_type: &str) -> NewMessage {
    NewMessage::builder("order", n.to_string(), event_type)
        .tenant_id(if n % 2 == 0 { "acme" } else { "globex" })
        .payload(&serde_json::json!({ "order": n }))
        .build()
        .expect("valid")
}

#[tokio::test]
async fn listings_page_by_key_count_with_a_bound_and_bucket_sent_rows() {
    let db = fresh_outbox().await;
    let messages: Vec<NewMessage> = (0..25)
        .map(|n| {
            event(
                n,
                if n < 20 {
                    "OrderPlaced"
                } else {
                    "OrderShipped"
                },
            )
        })
        .collect();
    enqueue_committed(&db, &messages).await;
    // 5 dead (with an error), 4 sent (two of them 3 minutes ago), the rest pending.
    let s = db.schema().to_owned();
    let run = |sql: String| {
        let pool = db.pool().clone();
        async move {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(&pool)
                .await
                .expect("sql");
        }
    };
    run(format!(
        "UPDATE \"{s}\".outbox_messages SET status = 3, last_error = 'Unroutable: NO_ROUTE 100%'
          WHERE seq IN (SELECT seq FROM \"{s}\".outbox_messages ORDER BY seq LIMIT 5);
         UPDATE \"{s}\".outbox_messages SET status = 1, sent_at = now()
          WHERE seq IN (SELECT seq FROM \"{s}\".outbox_messages ORDER BY seq OFFSET 5 LIMIT 2);
         UPDATE \"{s}\".outbox_messages SET status = 1, sent_at = now() - interval '3 minutes 10 seconds'
          WHERE seq IN (SELECT seq FROM \"{s}\".outbox_messages ORDER BY seq OFFSET 7 LIMIT 2);"
    ))
    .await;

    // Pending: 16 rows in claim order, in pages of 5, no row twice or missed.
    let all = MessageFilter::new();
    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let page = db
            .list_messages(MessageState::Pending, &all, after, 5)
            .await
            .expect("page");
        assert!(page.len() <= 5);
        let Some(last) = page.last() else { break };
        after = Some(last.cursor(MessageState::Pending));
        seen.extend(page.iter().map(|m| m.seq));
    }
    assert_eq!(seen.len(), 16);
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "claim order: {seen:?}"
    );

    // Dead: newest first, filtered by error text literally (`%` is no wildcard).
    let dead = db
        .list_messages(
            MessageState::Dead,
            &MessageFilter::new().with_error_containing("no_route 100%"),
            None,
            10,
        )
        .await
        .expect("dead");
    assert_eq!(dead.len(), 5);
    assert!(dead.windows(2).all(|w| w[0].seq > w[1].seq));
    let second = db
        .list_messages(
            MessageState::Dead,
            &all,
            Some(dead[1].cursor(MessageState::Dead)),
            10,
        )
        .await
        .expect("dead page 2");
    assert_eq!(
        second.iter().map(|m| m.id).collect::<Vec<Uuid>>(),
        dead[2..].iter().map(|m| m.id).collect::<Vec<_>>()
    );
    let none = db
        .list_messages(
            MessageState::Dead,
            &MessageFilter::new().with_error_containing("no_route 1000"),
            None,
            10,
        )
        .await
        .expect("dead");
    assert!(none.is_empty());

    // Filters by event type and tenant; counts stop at the bound.
    let shipped = MessageFilter::new()
        .with_event_type("OrderShipped")
        .with_tenant("acme");
    let rows = db
        .list_messages(MessageState::Pending, &shipped, None, 100)
        .await
        .expect("filtered");
    let want: BTreeSet<i64> = [20, 22, 24].into();
    assert_eq!(
        rows.iter()
            .map(|m| m.aggregate_id.parse::<i64>().expect("number"))
            .collect::<BTreeSet<_>>(),
        want
    );
    assert_eq!(
        db.count_messages(MessageState::Pending, &all, 1000)
            .await
            .expect("count"),
        16
    );
    assert_eq!(
        db.count_messages(MessageState::Pending, &all, 10)
            .await
            .expect("count"),
        10
    );
    assert_eq!(
        db.count_messages(MessageState::Sent, &all, 10)
            .await
            .expect("count"),
        4
    );
    assert_eq!(
        db.count_messages(MessageState::Pending, &shipped, 10)
            .await
            .expect("count"),
        3
    );

    // Sent: two in the minute just ended, two three minutes before.
    let series = db.sent_per_minute(60).await.expect("series");
    assert_eq!(series.counts.len(), 60);
    assert_eq!(series.counts[59], 2, "{:?}", series.counts);
    assert_eq!(series.counts[56], 2, "{:?}", series.counts);
    assert_eq!(series.counts.iter().sum::<u64>(), 4);
    let sent = db
        .list_messages(MessageState::Sent, &all, None, 10)
        .await
        .expect("sent");
    assert_eq!(sent.len(), 4);
    assert!(sent[0].sent_at >= sent[3].sent_at, "most recent first");

    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA \"{s}\" CASCADE")))
        .execute(db.pool())
        .await
        .expect("drop schema");
}
