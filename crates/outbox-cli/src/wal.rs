//! `outbox relay --source wal`: the [`WalRelay`] over PostgreSQL's logical replication
//! slot and RabbitMQ or NATS, with the same `/metrics` and `/healthz` endpoint and
//! health checker as the polling relay (docs/wal.md).

use std::sync::Arc;

use outboxkit_core::{DispatcherStats, OnDead, Ordering, OutboxAdmin as _};
use outboxkit_postgres::PgOutbox;
use outboxkit_postgres::wal::{WalRelay, WalRelayConfig};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::cli::OrderingMode;
use crate::config::RelaySettings;
use crate::error::CliError;
use crate::health::Health;
use crate::relay::{
    CLOSE_TIMEOUT, Relay, heartbeat, prometheus, publisher, redacted_broker, serve_endpoint,
};

/// Starts the WAL relay over `store`: checks `wal_level` and the slot first (a typed
/// error at once, not an unhealthy relay), then reads until `shutdown`.
pub(crate) async fn start(
    settings: &RelaySettings,
    store: PgOutbox,
    shutdown: CancellationToken,
) -> Result<Relay, CliError> {
    let wal = settings.wal_config()?;
    // Fail fast on what only the operator can fix; a slot being read by another relay
    // is fine (this one stands by).
    outboxkit_postgres::wal::check(&store, &wal).await?;
    let prometheus = prometheus()?;
    metrics::describe_gauge!(
        outboxkit_postgres::wal::WAL_RETAINED_BYTES,
        metrics::Unit::Bytes,
        "WAL retained by the relay's replication slot (pg_current_wal_lsn() - confirmed_flush_lsn)"
    );
    let publisher = Arc::new(crate::testing::Hooked::from_env(publisher(settings).await?));
    let config = WalRelayConfig::new(settings.db.url.clone())
        .with_batch_size(settings.batch_size)
        .with_retry(settings.retry_policies())
        .with_gauge_interval(settings.health_interval)
        .with_crash_loop_limit(settings.crash_loop_limit)
        .with_ordering(match settings.ordering {
            OrderingMode::PerKeySkip => Ordering::PerKey {
                on_dead: OnDead::Skip,
            },
            // `--ordering per-key` is refused for `--source wal` by the settings.
            OrderingMode::PerKey => Ordering::per_key(),
            OrderingMode::Unordered => Ordering::Unordered,
        })
        .with_lease(settings.lease)
        .with_linger(settings.wal_linger)
        .with_part_size(settings.wal_part_size)
        .with_concurrency(settings.concurrency);
    let store = Arc::new(store);
    let relay = WalRelay::new(
        (*store).clone(),
        wal.clone(),
        Arc::clone(&publisher),
        config,
    )?;
    let stats = relay.stats();
    let health = Health::new(settings.max_lag, settings.stuck_after, None);

    let (addr, server) = serve_endpoint(settings, &health, prometheus, &store, &shutdown).await?;
    let checker = {
        let health = health.clone();
        let token = shutdown.clone();
        let interval = settings.health_interval;
        let publisher = Arc::clone(&publisher);
        let store = Arc::clone(&store);
        let stats = stats.clone();
        let max_retained = settings.max_wal_retained;
        let sampled = health.clone();
        tokio::spawn(async move {
            health
                .run_checker(
                    store,
                    publisher,
                    interval,
                    move || {
                        sampled.wal_retained(stats.retained_bytes(), max_retained);
                        sampled.wal_session(stats.session_failing());
                        (stats.circuit_open(), stats.published())
                    },
                    Some(heartbeat()),
                    token,
                )
                .await;
        })
    };
    info!(
        listen = %addr,
        database = store.backend(),
        source = "wal",
        slot = wal.slot(),
        publication = wal.publication(),
        transport = ?settings.transport,
        broker = %redacted_broker(settings),
        schema = %settings.db.schema,
        sent_retention = ?settings.sent_retention,
        "relay started"
    );
    let task = {
        let token = shutdown.clone();
        let health = health.clone();
        tokio::spawn(async move {
            let result = relay.run(token.clone()).await;
            if let Err(e) = &result {
                health.relay_stopped(e.to_string());
            }
            token.cancel();
            let _ = checker.await;
            match server.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!(error = %e, "metrics endpoint failed"),
                Err(e) => warn!(error = %e, "metrics endpoint task failed"),
            }
            if tokio::time::timeout(CLOSE_TIMEOUT, publisher.inner().close())
                .await
                .is_err()
            {
                warn!("the broker connection did not close in time; leaving it");
            }
            let wal_stats = result?;
            info!(?wal_stats, "relay stopped");
            let mut stats = DispatcherStats::default();
            stats.published = wal_stats.published;
            stats.dead = wal_stats.dead;
            Ok(stats)
        })
    };
    Ok(Relay::from_parts(addr, health, shutdown, task))
}
