//! Push wake-up on the real PostgreSQL and RabbitMQ: the notification trigger sends one
//! `NOTIFY outbox` per transaction, a relay that polls only every minute publishes within
//! moments of a commit, and keeps doing so after its listening connection is killed.

mod common;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use common::rabbit::{Fixture, eventually, fixture};
use common::{database_url, enqueue_committed, fresh_outbox};
use lapin::types::FieldTable;
use outboxkit_core::{
    BlockedKey, ClaimedBatch, CompleteReport, Completion, Dispatcher, DispatcherConfig,
    MessageFilter, MessageStatus, NewMessage, OnDead, OutboxError, OutboxMessage, OutboxProducer,
    OutboxStats, OutboxStore, ReplayReport, WakeHandle,
};
use outboxkit_postgres::{NOTIFY_CHANNEL, PgConfig, PgOutbox};
use outboxkit_rabbit::{RabbitConfig, RabbitPublisher};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio_util::sync::CancellationToken;

fn orders(n: usize) -> Vec<NewMessage> {
    (0..n)
        .map(|i| {
            NewMessage::builder("order", i.to_string(), "OrderPlaced")
                .payload(&i)
                .build()
                .expect("valid")
        })
        .collect()
}

/// Notifications of `schema` on a listener, counted until two quiet seconds pass.
async fn notifications_until_quiet(listener: &mut PgListener, schema: &str) -> usize {
    let mut n = 0;
    while let Ok(Ok(notification)) =
        tokio::time::timeout(Duration::from_secs(2), listener.recv()).await
    {
        if notification.payload() == schema {
            n += 1;
        }
    }
    n
}

/// One notification per committed transaction that inserted rows, whatever the number
/// of rows and statements; none for a statement that inserted nothing, or a rolled-back
/// transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_notification_per_transaction() {
    let outbox = fresh_outbox().await;
    let mut listener = PgListener::connect(&database_url())
        .await
        .expect("listener");
    listener.listen(NOTIFY_CHANNEL).await.expect("LISTEN");

    // 2,500 rows in three statements of one transaction.
    enqueue_committed(&outbox, &orders(2_500)).await;
    assert_eq!(
        notifications_until_quiet(&mut listener, outbox.schema()).await,
        1
    );

    let mut tx = outbox.begin().await.expect("begin");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {}.outbox_messages (id, aggregate_type, aggregate_id, event_type, payload)
         SELECT gen_random_uuid(), 'a', 'b', 'C', '{{}}' WHERE false",
        outbox.schema()
    )))
    .execute(&mut *tx)
    .await
    .expect("insert nothing");
    tx.commit().await.expect("commit");
    let mut tx = outbox.begin().await.expect("begin");
    outbox
        .enqueue_batch(&mut tx, &orders(3))
        .await
        .expect("enqueue");
    tx.rollback().await.expect("rollback");
    assert_eq!(
        notifications_until_quiet(&mut listener, outbox.schema()).await,
        0,
        "no rows inserted, or nothing committed: no notification"
    );
}

/// Once PostgreSQL's notification queue is half full (a listener that stopped reading
/// lets it grow until NOTIFY, and with it the producer's commit, fails), the trigger
/// sends nothing: commits go through, and only the wake-up is lost (the relays' poll
/// remains). The queue's usage is stood in for by a function of the same name ahead of
/// `pg_catalog` on the producer's `search_path` (filling the real 8 GB queue is not a
/// test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_full_notification_queue_sends_nothing_and_fails_no_commit() {
    let outbox = fresh_outbox().await;
    let fake = format!("usage_{}", uuid::Uuid::new_v4().simple());
    let mut listener = PgListener::connect(&database_url())
        .await
        .expect("listener");
    listener.listen(NOTIFY_CHANNEL).await.expect("LISTEN");
    for (usage, expected) in [(0.9, 0), (0.1, 1)] {
        let mut tx = outbox.begin().await.expect("begin");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE SCHEMA IF NOT EXISTS {fake};
             CREATE OR REPLACE FUNCTION {fake}.pg_notification_queue_usage()
                 RETURNS double precision LANGUAGE sql AS 'SELECT {usage}::float8';
             SET LOCAL search_path = {fake}, pg_catalog, public;"
        )))
        .execute(&mut *tx)
        .await
        .expect("stand-in usage");
        outbox
            .enqueue_batch(&mut tx, &orders(3))
            .await
            .expect("the insert goes through");
        tx.commit().await.expect("the commit goes through");
        assert_eq!(
            notifications_until_quiet(&mut listener, outbox.schema()).await,
            expected,
            "queue usage {usage}"
        );
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {fake} CASCADE")))
        .execute(outbox.pool())
        .await
        .expect("drop");
}

/// A dispatcher over `outbox` (with its push wake-up, started by `run`) that polls only
/// once a minute, even right after a claim
/// that found messages, publishing to an exchange of its own (the fixture keeps it,
/// with a bound queue).
async fn slow_polling_dispatcher<S: OutboxStore>(
    outbox: &Arc<S>,
) -> (Dispatcher<S, RabbitPublisher>, Fixture) {
    let fx = fixture(true, FieldTable::default()).await;
    let publisher = RabbitPublisher::connect(
        RabbitConfig::new(common::rabbit::amqp_url())
            .with_exchange(&fx.exchange)
            .with_declare_exchange(false),
    )
    .await
    .expect("publisher");
    let dispatcher = Dispatcher::new(
        Arc::clone(outbox),
        Arc::new(publisher),
        DispatcherConfig::new()
            .with_poll_interval(Duration::from_secs(60))
            .with_min_poll_interval(Duration::from_secs(60)),
    )
    .expect("valid dispatcher config");
    (dispatcher, fx)
}

/// Whether every one of `messages` is `Sent` within 10 seconds.
async fn sent_within_10s(outbox: &Arc<PgOutbox>, messages: &[NewMessage]) -> bool {
    let ids: Vec<uuid::Uuid> = messages.iter().map(|m| m.id).collect();
    eventually(Duration::from_secs(10), || {
        let ids = ids.clone();
        let outbox = Arc::clone(outbox);
        async move {
            for id in ids {
                let m = outbox.get(id).await.expect("get").expect("row");
                if m.status != MessageStatus::Sent {
                    return false;
                }
            }
            true
        }
    })
    .await
}

/// The backend of the connection listening for `application_name`, once it listens.
async fn listening_backend(admin: &sqlx::PgPool, application_name: &str) -> Option<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'",
    )
    .bind(application_name)
    .fetch_optional(admin)
    .await
    .expect("pg_stat_activity")
}

/// The relay's store, whose push wake-up is the one of another `PgOutbox` over the same
/// schema (`listening`: a pool of another role, or through a proxy), so that the faults a
/// test injects into the listener's connections leave the relay's claims alone. The
/// dispatcher starts the wake-up itself, as it does for a plain `PgOutbox`.
struct ListeningElsewhere {
    store: PgOutbox,
    listening: PgOutbox,
}

#[async_trait]
impl OutboxStore for ListeningElsewhere {
    async fn claim(&self, n: usize, lease: Duration) -> Result<ClaimedBatch, OutboxError> {
        self.store.claim(n, lease).await
    }
    async fn claim_ordered(
        &self,
        n: usize,
        lease: Duration,
        on_dead: OnDead,
    ) -> Result<ClaimedBatch, OutboxError> {
        self.store.claim_ordered(n, lease, on_dead).await
    }
    async fn claim_held(
        &self,
        destinations: &[String],
        lease: Duration,
        order: Option<OnDead>,
    ) -> Result<ClaimedBatch, OutboxError> {
        self.store.claim_held(destinations, lease, order).await
    }
    async fn release_held(&self, destination: &str, limit: usize) -> Result<u64, OutboxError> {
        self.store.release_held(destination, limit).await
    }
    async fn held_destinations(
        &self,
        after: &str,
        limit: usize,
    ) -> Result<Vec<String>, OutboxError> {
        self.store.held_destinations(after, limit).await
    }
    async fn blocked_keys(&self, limit: usize) -> Result<Vec<BlockedKey>, OutboxError> {
        self.store.blocked_keys(limit).await
    }
    async fn complete(&self, completions: &[Completion]) -> Result<CompleteReport, OutboxError> {
        self.store.complete(completions).await
    }
    async fn get(&self, id: uuid::Uuid) -> Result<Option<OutboxMessage>, OutboxError> {
        self.store.get(id).await
    }
    async fn stats(&self) -> Result<OutboxStats, OutboxError> {
        self.store.stats().await
    }
    async fn dead_letters(
        &self,
        filter: &MessageFilter,
        limit: usize,
    ) -> Result<Vec<OutboxMessage>, OutboxError> {
        self.store.dead_letters(filter, limit).await
    }
    async fn replay(
        &self,
        filter: &MessageFilter,
        dry_run: bool,
    ) -> Result<ReplayReport, OutboxError> {
        self.store.replay(filter, dry_run).await
    }
    async fn purge_sent(&self, older_than: Duration, batch: usize) -> Result<u64, OutboxError> {
        self.store.purge_sent(older_than, batch).await
    }
    fn spawn_wake_source(
        &self,
        wake: WakeHandle,
        shutdown: CancellationToken,
    ) -> Option<tokio::task::JoinHandle<()>> {
        self.listening.spawn_wake_source(wake, shutdown)
    }
}

/// A dispatcher built plainly over a `PgOutbox`, polling only once a minute (even right
/// after a claim that found messages), publishes a message committed after it went idle
/// within seconds: it LISTENs by itself. Without its push wake-up
/// (`with_push_wake(false)`) the same message waits for the poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_dispatcher_over_pg_outbox_is_woken_by_its_commits() {
    for push in [true, false] {
        let migrated = fresh_outbox().await;
        let outbox = Arc::new(migrated.clone());
        let fx = fixture(true, FieldTable::default()).await;
        let publisher = RabbitPublisher::connect(
            RabbitConfig::new(common::rabbit::amqp_url())
                .with_exchange(&fx.exchange)
                .with_declare_exchange(false),
        )
        .await
        .expect("publisher");
        let dispatcher = Dispatcher::new(
            Arc::clone(&outbox),
            Arc::new(publisher),
            DispatcherConfig::new()
                .with_poll_interval(Duration::from_secs(60))
                .with_min_poll_interval(Duration::from_secs(60))
                .with_push_wake(push),
        )
        .expect("valid dispatcher config");
        let first = orders(1);
        enqueue_committed(&migrated, &first).await;
        let token = CancellationToken::new();
        let relay = {
            let (d, t) = (dispatcher.clone(), token.clone());
            tokio::spawn(async move { d.run(t).await })
        };
        // Its first claim found a message: the relay now waits a minute unless woken.
        assert!(sent_within_10s(&outbox, &first).await, "the first claim");
        let second = orders(3);
        enqueue_committed(&migrated, &second).await;
        assert_eq!(
            sent_within_10s(&outbox, &second).await,
            push,
            "push wake-up {push}: published within 10 s of the commit (poll interval 60 s)"
        );
        token.cancel();
        relay.await.expect("join").expect("relay");
        drop((fx, migrated));
    }
}

/// A relay polling only once a minute publishes a committed message within seconds:
/// the notification wakes it. After its listening connection is terminated it
/// reconnects by itself and the next message is just as fast.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_wakes_a_slow_polling_relay_and_survives_a_lost_connection() {
    let migrated = fresh_outbox().await;
    let application_name = format!("wake-{}", uuid::Uuid::new_v4().simple());
    let options: PgConnectOptions = database_url().parse().expect("database URL");
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.application_name(&application_name))
        .await
        .expect("connect");
    let outbox = Arc::new(
        PgOutbox::new(pool, &PgConfig::default().with_schema(migrated.schema())).expect("outbox"),
    );
    let (dispatcher, _fx) = slow_polling_dispatcher(&outbox).await;
    let token = CancellationToken::new();
    let relay = {
        let (d, t) = (dispatcher.clone(), token.clone());
        tokio::spawn(async move { d.run(t).await })
    };
    let admin = migrated.pool();
    assert!(
        eventually(Duration::from_secs(10), || async {
            listening_backend(admin, &application_name).await.is_some()
        })
        .await,
        "the relay listens"
    );
    // The relay's first claims found nothing: it now waits up to a minute.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let first = orders(5);
    enqueue_committed(&migrated, &first).await;
    assert!(
        sent_within_10s(&outbox, &first).await,
        "a notification woke the relay"
    );

    let pid = listening_backend(admin, &application_name)
        .await
        .expect("listening backend");
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .execute(admin)
        .await
        .expect("terminate the listener's connection");
    assert!(
        eventually(Duration::from_secs(30), || async {
            listening_backend(admin, &application_name)
                .await
                .is_some_and(|new| new != pid)
        })
        .await,
        "the listener reconnects by itself"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let second = orders(5);
    enqueue_committed(&migrated, &second).await;
    assert!(
        sent_within_10s(&outbox, &second).await,
        "the reconnected listener wakes the relay"
    );
    token.cancel();
    relay.await.expect("join").expect("relay");
}

/// While the listener cannot listen (its role locked out: connections terminated, new
/// ones refused, as in a failover) a relay whose fallback poll is a minute still
/// publishes within seconds: the listener wakes it every 500 ms until it listens again.
/// The relay's own store connects as another role and keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_that_cannot_listen_stands_in_for_the_notifications() {
    let migrated = fresh_outbox().await;
    let admin = migrated.pool();
    let options: PgConnectOptions = database_url().parse().expect("database URL");
    let lockout = outboxkit_testkit::pg::PgLockout::new(admin, &options, migrated.schema()).await;
    let listen_pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(lockout.connect_options())
        .await
        .expect("connect as the listener's role");
    let listening = PgOutbox::new(
        listen_pool,
        &PgConfig::default().with_schema(migrated.schema()),
    )
    .expect("outbox");
    let outbox = Arc::new(migrated.clone());
    let relay_store = Arc::new(ListeningElsewhere {
        store: migrated.clone(),
        listening,
    });
    let (dispatcher, _fx) = slow_polling_dispatcher(&relay_store).await;
    let token = CancellationToken::new();
    lockout.lock_out().await;
    let relay = {
        let (d, t) = (dispatcher.clone(), token.clone());
        tokio::spawn(async move { d.run(t).await })
    };
    // The relay's first claims found nothing: its own poll now waits a minute.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let batch = orders(5);
    enqueue_committed(&migrated, &batch).await;
    let sent = sent_within_10s(&outbox, &batch).await;
    lockout.let_in().await;
    token.cancel();
    relay.await.expect("join").expect("relay");
    lockout.drop_role().await;
    assert!(sent, "the listener's stand-in wakes published the messages");
}

/// A relay whose listener connects through a proxy (only the listener: the relay's own
/// store connects directly), polling only once a minute.
async fn listening_through(
    proxy: &outboxkit_testkit::pg::RoundTripCounter,
    migrated: &PgOutbox,
) -> PgOutbox {
    let options: PgConnectOptions = database_url().parse().expect("database URL");
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(3))
        .connect_with(proxy.options(&options))
        .await
        .expect("connect through the proxy");
    let config = PgConfig::default()
        .with_schema(migrated.schema())
        .with_listener_keepalive(Duration::from_secs(2));
    PgOutbox::new(pool, &config).expect("outbox")
}

/// The listener's connection goes half-open (both ends still open, nothing passes, as
/// when a peer or a middlebox vanishes without a word): the listener finds out within its
/// keepalive (2 s here) and the 5 s its check may take, stands in for the notifications
/// while it reconnects, and a relay polling once a minute still publishes within
/// seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_listener_connection_is_found_and_replaced() {
    let migrated = fresh_outbox().await;
    let proxy = outboxkit_testkit::pg::RoundTripCounter::start("127.0.0.1:5432").await;
    let listening = listening_through(&proxy, &migrated).await;
    let outbox = Arc::new(migrated.clone());
    let relay_store = Arc::new(ListeningElsewhere {
        store: migrated.clone(),
        listening,
    });
    let (dispatcher, _fx) = slow_polling_dispatcher(&relay_store).await;
    let token = CancellationToken::new();
    let relay = {
        let (d, t) = (dispatcher.clone(), token.clone());
        tokio::spawn(async move { d.run(t).await })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let first = orders(5);
    enqueue_committed(&migrated, &first).await;
    assert!(
        sent_within_10s(&outbox, &first).await,
        "a notification woke the relay"
    );

    proxy.freeze_open_connections();
    // Past the listener's stand-in wakes of its first connection and the relay's
    // claims: the relay now waits a minute unless woken.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let second = orders(5);
    enqueue_committed(&migrated, &second).await;
    assert!(
        sent_within_10s(&outbox, &second).await,
        "the half-open connection was found and the relay woken"
    );
    token.cancel();
    relay.await.expect("join").expect("relay");
}

/// `LISTEN` succeeds but no notification ever arrives (what a connection pooler in
/// transaction mode, such as PgBouncer's, does in effect; here a proxy drops them): the
/// listener's self-test finds out at start, it says so and stands in for the
/// notifications, and a relay polling once a minute still publishes within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_that_hears_nothing_says_so_and_stands_in() {
    let migrated = fresh_outbox().await;
    let proxy = outboxkit_testkit::pg::RoundTripCounter::start("127.0.0.1:5432").await;
    proxy.drop_notifications(true);
    let listening = listening_through(&proxy, &migrated).await;
    let outbox = Arc::new(migrated.clone());
    let relay_store = Arc::new(ListeningElsewhere {
        store: migrated.clone(),
        listening,
    });
    let (dispatcher, _fx) = slow_polling_dispatcher(&relay_store).await;
    let token = CancellationToken::new();
    let relay = {
        let (d, t) = (dispatcher.clone(), token.clone());
        tokio::spawn(async move { d.run(t).await })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let batch = orders(5);
    enqueue_committed(&migrated, &batch).await;
    assert!(
        sent_within_10s(&outbox, &batch).await,
        "the listener's stand-in wakes published the messages"
    );
    token.cancel();
    relay.await.expect("join").expect("relay");
}
