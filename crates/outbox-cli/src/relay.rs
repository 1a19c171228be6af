//! `outbox relay`: the dispatcher over PostgreSQL and RabbitMQ or NATS, with the
//! `/metrics` and `/healthz` endpoint and the health checker.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use outboxkit_core::{Dispatcher, DispatcherStats, OnDead, Ordering, OutboxAdmin};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::cli::{OrderingMode, TransportKind};
use crate::config::RelaySettings;
use crate::config::TransportExt as _;
use crate::database::DatabaseKind;
use crate::error::CliError;
use crate::health::Health;

/// How long closing the broker connection may take at exit.
pub(crate) const CLOSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// The relay's publisher: RabbitMQ or NATS, chosen at run time (the `outboxkit` facade's,
/// shared with the examples). Both connect lazily, so the relay starts (and reports
/// unhealthy) while the broker is down.
pub(crate) use outboxkit::AnyPublisher;

/// The publisher `settings` ask for, connecting lazily.
///
/// # Errors
/// [`CliError::FeatureMissing`] for a transport compiled out, [`CliError::Rabbit`] /
/// [`CliError::Nats`] for an invalid transport configuration.
pub(crate) async fn publisher(settings: &RelaySettings) -> Result<AnyPublisher, CliError> {
    let config: outboxkit::AnyPublisherConfig = match settings.transport.require()? {
        #[cfg(feature = "rabbit")]
        TransportKind::Rabbit => settings.rabbit_config()?.into(),
        #[cfg(feature = "nats")]
        TransportKind::Nats => settings.nats_config()?.into(),
        #[allow(unreachable_patterns)] // reason: `require` failed for a compiled-out one
        other => return Err(other.missing()),
    };
    Ok(AnyPublisher::connect_lazy(config).await?)
}

/// How often the recorder's histogram samples are drained into their buckets, scraped
/// or not.
const METRICS_UPKEEP: std::time::Duration = std::time::Duration::from_secs(5);

/// Installs the process-wide Prometheus recorder once (later calls return the same
/// handle), with histogram buckets for the latency and batch-size series, starts the
/// thread that drains histogram samples every 5 s (so memory stays flat when nothing
/// scrapes `/metrics`), and registers the descriptions of the relay and inbox metrics.
///
/// # Errors
/// [`CliError::Metrics`] when another recorder is already installed.
pub(crate) fn prometheus() -> Result<PrometheusHandle, CliError> {
    static HANDLE: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let seconds = [
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0, 300.0,
            ];
            let sizes = [
                1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0,
            ];
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &seconds)
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(outboxkit_core::metrics::CLAIM_BATCH_SIZE.into()),
                        &sizes,
                    )
                })
                .map_err(|e| e.to_string())?
                .build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).map_err(|e| e.to_string())?;
            // Histograms keep every sample until an upkeep drains them into their
            // buckets; a scrape runs one, but nothing may scrape (issue 27: about 23
            // bytes per message, unbounded). So drain every 5 s regardless, on a thread
            // of its own: this may run before or outside any runtime.
            let upkeep = handle.clone();
            std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || {
                    loop {
                        std::thread::sleep(METRICS_UPKEEP);
                        upkeep.run_upkeep();
                    }
                })
                .map_err(|e| format!("cannot start the metrics upkeep thread: {e}"))?;
            outboxkit_core::metrics::describe();
            outboxkit_inbox::metrics::describe();
            Ok(handle)
        })
        .clone()
        .map_err(CliError::Metrics)
}

/// The `/metrics` and `/healthz` routes.
pub(crate) fn router(health: Health, prometheus: PrometheusHandle) -> Router {
    Router::new()
        .route("/metrics", get(metrics_endpoint))
        .route("/healthz", get(healthz_endpoint))
        .with_state((health, prometheus))
}

async fn metrics_endpoint(State((_, prometheus)): State<(Health, PrometheusHandle)>) -> Response {
    prometheus.run_upkeep();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        prometheus.render(),
    )
        .into_response()
}

async fn healthz_endpoint(State((health, _)): State<(Health, PrometheusHandle)>) -> Response {
    let report = health.report();
    let code = if report.is_healthy() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, axum::Json(report)).into_response()
}

/// A running relay: the dispatcher, the health checker and the HTTP endpoint.
#[derive(Debug)]
pub struct Relay {
    addr: SocketAddr,
    health: Health,
    shutdown: CancellationToken,
    task: JoinHandle<Result<DispatcherStats, CliError>>,
}

impl Relay {
    /// Connects to the database (eagerly: a wrong URL fails here), creates the
    /// publisher (lazily: a down broker makes the relay unhealthy, not failed), binds
    /// the endpoint and starts everything. Cancel `shutdown` to stop it gracefully.
    ///
    /// # Errors
    /// [`CliError::Store`] when the database cannot be reached,
    /// [`CliError::Rabbit`]/[`CliError::Nats`] for a bad transport configuration,
    /// [`CliError::Listen`] when the address is taken, [`CliError::Metrics`].
    pub async fn start(
        settings: &RelaySettings,
        shutdown: CancellationToken,
    ) -> Result<Self, CliError> {
        let retention = settings.sent_retention.into();
        match settings.db.kind()?.require()? {
            #[cfg(feature = "postgres")]
            DatabaseKind::Postgres => {
                let store = outboxkit_postgres::PgOutbox::connect(
                    &settings
                        .db
                        .pg_config()
                        .with_sent_retention(retention)
                        .with_crash_loop_limit(settings.crash_loop_limit),
                )
                .await?;
                if settings.source == crate::cli::SourceKind::Wal {
                    return crate::wal::start(settings, store, shutdown).await;
                }
                // Push wake-up: the dispatcher starts the store's LISTEN itself, so a
                // committed insert wakes the claimer at once; polling stays as the
                // fallback.
                Self::start_on(settings, store, shutdown).await
            }
            #[cfg(feature = "sqlserver")]
            DatabaseKind::SqlServer => {
                let store = outboxkit_sqlserver::MssqlOutbox::connect(
                    &settings
                        .db
                        .mssql_config()?
                        .with_sent_retention(retention)
                        .with_crash_loop_limit(settings.crash_loop_limit),
                )
                .await?;
                // No push on SQL Server: the dispatcher's adaptive polling.
                Self::start_on(settings, store, shutdown).await
            }
            #[cfg(feature = "mysql")]
            DatabaseKind::MySql => {
                let store = outboxkit_mysql::MySqlOutbox::connect(
                    &settings
                        .db
                        .mysql_config()
                        .with_sent_retention(retention)
                        .with_crash_loop_limit(settings.crash_loop_limit),
                )
                .await?;
                // No push on MySQL either: the dispatcher's adaptive polling.
                Self::start_on(settings, store, shutdown).await
            }
            #[allow(unreachable_patterns)] // reason: `require` failed for a compiled-out one
            other => Err(other.missing()),
        }
    }

    /// [`start`](Self::start) over a connected `store` (the dispatcher starts the
    /// store's push wake-up, PostgreSQL's LISTEN, itself).
    async fn start_on<S>(
        settings: &RelaySettings,
        store: S,
        shutdown: CancellationToken,
    ) -> Result<Self, CliError>
    where
        S: OutboxAdmin,
    {
        let prometheus = prometheus()?;
        let publisher = Arc::new(crate::testing::Hooked::from_env(publisher(settings).await?));
        let config = dispatcher_config(settings);
        let ordered = match config.ordering() {
            Ordering::PerKey { on_dead } => Some(on_dead),
            _ => None,
        };
        let store = Arc::new(store);
        let backend = store.backend();
        let dispatcher = Dispatcher::new(Arc::clone(&store), Arc::clone(&publisher), config)?;
        let health = Health::new(settings.max_lag, settings.stuck_after, ordered);

        let (addr, server) =
            serve_endpoint(settings, &health, prometheus, &store, &shutdown).await?;
        let checker = {
            let health = health.clone();
            let token = shutdown.clone();
            let d = dispatcher.clone();
            let interval = settings.health_interval;
            let publisher = Arc::clone(&publisher);
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                health
                    .run_checker(
                        store,
                        publisher,
                        interval,
                        move || (d.circuit_open(), d.stats().published),
                        Some(heartbeat()),
                        token,
                    )
                    .await;
            })
        };
        info!(
            listen = %addr,
            database = backend,
            transport = ?settings.transport,
            broker = %redacted_broker(settings),
            schema = %settings.db.schema,
            ordering = ?settings.ordering,
            sent_retention = ?settings.sent_retention,
            dashboard = settings.dashboard.is_some(),
            "relay started"
        );
        let task = {
            let token = shutdown.clone();
            let health = health.clone();
            tokio::spawn(async move {
                let result = dispatcher.run(token.clone()).await;
                if let Err(e) = &result {
                    health.relay_stopped(e.to_string());
                }
                // The relay is what the process is for: without it, stop serving.
                token.cancel();
                let _ = checker.await;
                match server.await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => warn!(error = %e, "metrics endpoint failed"),
                    Err(e) => warn!(error = %e, "metrics endpoint task failed"),
                }
                // Best effort, and short: every message was confirmed or released
                // already, and a frozen broker must not hold the exit past the drain.
                if tokio::time::timeout(CLOSE_TIMEOUT, publisher.inner().close())
                    .await
                    .is_err()
                {
                    warn!("the broker connection did not close in time; leaving it");
                }
                let stats = result?;
                info!(?stats, "relay stopped");
                Ok(stats)
            })
        };
        Ok(Self {
            addr,
            health,
            shutdown,
            task,
        })
    }

    /// A relay started elsewhere (the WAL source, `crate::wal`, PostgreSQL only).
    #[cfg(feature = "postgres")]
    pub(crate) fn from_parts(
        addr: SocketAddr,
        health: Health,
        shutdown: CancellationToken,
        task: JoinHandle<Result<DispatcherStats, CliError>>,
    ) -> Self {
        Self {
            addr,
            health,
            shutdown,
            task,
        }
    }

    /// The bound address of `/metrics` and `/healthz` (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The health state served by `/healthz`.
    pub fn health(&self) -> &Health {
        &self.health
    }

    /// Asks the relay to stop (same as cancelling the token given to
    /// [`start`](Self::start)).
    pub fn stop(&self) {
        self.shutdown.cancel();
    }

    /// Waits until the relay has stopped; returns the dispatcher's counters.
    ///
    /// # Errors
    /// The dispatcher's fatal error ([`CliError::Store`]) or [`CliError::Task`] when a
    /// task panicked.
    pub async fn wait(self) -> Result<DispatcherStats, CliError> {
        self.task.await.map_err(|e| CliError::Task(e.to_string()))?
    }
}

/// Binds `settings.listen` and serves `/metrics` and `/healthz` there (and the
/// dashboard's pages when `settings.dashboard` asks for them) until `shutdown`: the
/// polling relay's and the WAL relay's endpoint alike. Returns the bound address and
/// the server's task.
///
/// # Errors
/// [`CliError::Listen`] when the address cannot be bound; the dashboard's address
/// check.
pub(crate) async fn serve_endpoint<S: OutboxAdmin + 'static>(
    settings: &RelaySettings,
    health: &Health,
    prometheus: PrometheusHandle,
    store: &Arc<S>,
    shutdown: &CancellationToken,
) -> Result<(SocketAddr, JoinHandle<std::io::Result<()>>), CliError> {
    let listen_error = |source| CliError::Listen {
        addr: settings.listen,
        source,
    };
    let listener = tokio::net::TcpListener::bind(settings.listen)
        .await
        .map_err(listen_error)?;
    let addr = listener.local_addr().map_err(listen_error)?;
    let mut app = router(health.clone(), prometheus);
    if let Some(pages) = &settings.dashboard {
        pages.check_address(settings.listen)?;
        let admin: Arc<dyn OutboxAdmin> = store.clone();
        app = app.merge(crate::commands::dashboard::router(
            crate::commands::dashboard::Dashboard::new(admin, pages, Some(health.clone())),
        ));
    }
    let token = shutdown.clone();
    let server = tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(token.cancelled_owned())
        .await
    });
    Ok((addr, server))
}

pub(crate) fn redacted_broker(settings: &RelaySettings) -> String {
    crate::config::redact_broker_url(Some(settings.transport), &settings.broker_url)
}

/// The dispatcher configuration of `settings`, ordering included.
fn dispatcher_config(settings: &RelaySettings) -> outboxkit_core::DispatcherConfig {
    let ordering = match settings.ordering {
        OrderingMode::Unordered => Ordering::Unordered,
        OrderingMode::PerKey => Ordering::PerKey {
            on_dead: OnDead::Block,
        },
        OrderingMode::PerKeySkip => Ordering::PerKey {
            on_dead: OnDead::Skip,
        },
    };
    settings.dispatcher_config().with_ordering(ordering)
}

/// This process's heartbeat: a fresh relay id, the host name (the kernel's, else
/// `$HOSTNAME`, else `unknown`), the process id and the binary's version.
pub(crate) fn heartbeat() -> outboxkit_core::RelayHeartbeat {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".to_owned());
    outboxkit_core::RelayHeartbeat::new(
        uuid::Uuid::now_v7(),
        host,
        std::process::id(),
        env!("CARGO_PKG_VERSION"),
    )
}

/// Waits for SIGINT or SIGTERM (SIGINT only on non-Unix), then cancels `token`.
pub(crate) async fn cancel_on_signal(token: CancellationToken) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => info!("SIGINT received, shutting down"),
                    _ = term.recv() => info!("SIGTERM received, shutting down"),
                    () = token.cancelled() => return,
                }
            }
            Err(e) => {
                warn!(error = %e, "cannot listen for SIGTERM; SIGINT only");
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => info!("SIGINT received, shutting down"),
                    () = token.cancelled() => return,
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => info!("SIGINT received, shutting down"),
            () = token.cancelled() => return,
        }
    }
    token.cancel();
}
