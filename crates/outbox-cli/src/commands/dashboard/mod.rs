//! `outbox dashboard`: the operations dashboard in the browser, and the same pages
//! mounted by `outbox relay --dashboard` on the relay's HTTP server.
//!
//! Server-rendered HTML (maud escapes every value it interpolates), a few lines of
//! plain JavaScript for live refresh, assets compiled into the binary. Everything goes
//! through [`OutboxAdmin`], so it works on every backend.
//!
//! One file per concern:
//! - this one: the arguments, the settings, the router and the server;
//! - `security`: authentication, the Host check, CSRF, response headers, timings;
//! - `layout`: the page shell, the assets and the formatting helpers;
//! - `overview`, `messages` (listings, detail, blocked keys), `inbox` (consumer dead
//!   letters) and `replay` (dry-run preview, confirmation, audit log): the pages.
//!
//! Safe by default: read-only unless started with `--allow-replay`; bound to
//! 127.0.0.1 unless told otherwise; on any other address it refuses to start without
//! a token (`OUTBOX_DASHBOARD_TOKEN`). See docs/operations.md.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use clap::Args;
use outboxkit_core::{OutboxAdmin, OutboxError};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::config::DbSettings;
use crate::error::CliError;
use crate::health::Health;

mod filter;
mod inbox;
mod layout;
mod messages;
mod overview;
mod replay;
mod security;

/// The environment variable holding the dashboard's access token. Requests must carry
/// `Authorization: Bearer TOKEN`, or basic authentication with any user name and
/// TOKEN as the password (what a browser prompts for). Never a flag: command lines
/// are visible to every user of the host.
pub const TOKEN_ENV: &str = "OUTBOX_DASHBOARD_TOKEN";

/// Default address of `outbox dashboard`: loopback only.
const DEFAULT_LISTEN: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(
    std::net::Ipv4Addr::LOCALHOST,
    9465,
));

/// `outbox dashboard`
#[derive(Debug, Default, Args)]
pub(crate) struct DashboardArgs {
    /// Address to serve the dashboard on [default: 127.0.0.1:9465]. Any address that
    /// is not loopback needs OUTBOX_DASHBOARD_TOKEN.
    #[arg(long, env = "OUTBOX_DASHBOARD_LISTEN", value_name = "ADDR")]
    pub listen: Option<String>,

    /// Allow replaying dead letters from the dashboard (dry run and confirmation
    /// first); read-only without it.
    #[arg(long, env = "OUTBOX_DASHBOARD_ALLOW_REPLAY")]
    pub allow_replay: bool,
}

/// What the dashboard pages need beyond the database: resolved and validated.
/// `Debug` hides the token.
#[derive(Clone)]
pub struct DashboardSettings {
    /// Where `outbox dashboard` listens (the relay mounts the pages on its own address).
    pub listen: SocketAddr,
    /// Whether the replay forms are enabled.
    pub allow_replay: bool,
    /// The access token (from [`TOKEN_ENV`]); `None`: no authentication, loopback only.
    pub token: Option<String>,
}

impl std::fmt::Debug for DashboardSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            listen,
            allow_replay,
            token,
        } = self;
        f.debug_struct("DashboardSettings")
            .field("listen", listen)
            .field("allow_replay", allow_replay)
            .field("token", &token.as_ref().map(|_| "***"))
            .finish()
    }
}

impl DashboardSettings {
    /// Loopback, read-only, no token.
    pub fn new() -> Self {
        Self {
            listen: DEFAULT_LISTEN,
            allow_replay: false,
            token: None,
        }
    }

    /// The token from [`TOKEN_ENV`] (an empty value counts as none).
    pub fn token_from_env() -> Option<String> {
        std::env::var(TOKEN_ENV).ok().filter(|t| !t.is_empty())
    }

    /// Refuses what is unsafe: serving on an address that is not loopback without a
    /// token. `addr` is where the pages will be served (the relay's `--listen` when it
    /// mounts them).
    ///
    /// # Errors
    /// [`CliError::Invalid`] (`listen`).
    pub fn check_address(&self, addr: SocketAddr) -> Result<(), CliError> {
        if !addr.ip().is_loopback() && self.token.is_none() {
            return Err(CliError::Invalid {
                field: "listen",
                reason: format!(
                    "the dashboard refuses to serve on {addr}, which is not a loopback \
                     address, without authentication: set {TOKEN_ENV}"
                ),
            });
        }
        Ok(())
    }

    /// Resolves `outbox dashboard`'s flags and the token.
    ///
    /// # Errors
    /// [`CliError::Invalid`] for an address that does not parse, or one that is not
    /// loopback without a token.
    pub(crate) fn resolve(args: &DashboardArgs) -> Result<Self, CliError> {
        let mut s = Self::new();
        if let Some(addr) = args.listen.as_deref() {
            s.listen = addr.parse().map_err(|e| CliError::Invalid {
                field: "listen",
                reason: format!("{addr:?} is not a socket address (host:port): {e}"),
            })?;
        }
        s.allow_replay = args.allow_replay;
        s.token = Self::token_from_env();
        s.check_address(s.listen)?;
        Ok(s)
    }
}

impl Default for DashboardSettings {
    fn default() -> Self {
        Self::new()
    }
}

/// The pages' shared state.
#[derive(Clone)]
pub(crate) struct Dashboard {
    admin: Arc<dyn OutboxAdmin>,
    /// The relay's health, when the relay mounts the pages.
    health: Option<Health>,
    allow_replay: bool,
    token: Option<Arc<str>>,
    /// The CSRF token of this process: random, embedded in every form, required by
    /// every POST.
    csrf: Arc<str>,
    /// What the header says about the database (backend and schema; never the URL).
    database: Arc<str>,
}

impl Dashboard {
    /// The state for `admin` with `settings`; `health` when mounted by the relay.
    pub(crate) fn new(
        admin: Arc<dyn OutboxAdmin>,
        settings: &DashboardSettings,
        health: Option<Health>,
    ) -> Self {
        let database = format!("{} · schema {}", admin.backend(), admin.schema());
        Self {
            admin,
            health,
            allow_replay: settings.allow_replay,
            token: settings.token.as_deref().map(Arc::from),
            csrf: security::new_csrf_token().into(),
            database: database.into(),
        }
    }
}

/// The dashboard's routes with their layers (authentication, Host check, security
/// headers, timings). Merged into the relay's router by `--dashboard`; the layers
/// apply to these routes only (the relay's `/metrics` and `/healthz` stay open).
pub(crate) fn router(dashboard: Dashboard) -> Router {
    Router::new()
        .route("/", get(overview::page))
        .route("/messages", get(messages::list))
        .route("/messages/{id}", get(messages::detail))
        .route("/blocked", get(messages::blocked))
        .route("/inbox", get(inbox::list))
        .route("/inbox/{id}", get(inbox::detail))
        .route("/replay", get(replay::preview).post(replay::confirm))
        .route(
            "/inbox/replay",
            get(replay::inbox_preview).post(replay::inbox_confirm),
        )
        .route("/assets/dashboard.css", get(layout::css))
        .route("/assets/dashboard.js", get(layout::js))
        .layer(axum::middleware::from_fn_with_state(
            dashboard.clone(),
            security::guard,
        ))
        .with_state(dashboard)
}

/// A page that could not be rendered, shown as an escaped error page.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PageError {
    /// The request is malformed (a filter that does not parse, a missing field).
    #[error("bad request: {0}")]
    BadRequest(String),
    /// No such message.
    #[error("not found: {0}")]
    NotFound(String),
    /// Refused: read-only mode, or the CSRF token is missing or wrong.
    #[error("forbidden: {0}")]
    Forbidden(&'static str),
    /// The state changed between the preview and the confirmation.
    #[error("conflict: {0}")]
    Conflict(String),
    /// The database failed.
    #[error(transparent)]
    Store(#[from] OutboxError),
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        let status = match &self {
            Self::BadRequest(_) => StatusCode::BAD_REQUEST,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::Conflict(_) => StatusCode::CONFLICT,
            Self::Store(e) => {
                tracing::warn!(error = %e, "dashboard page failed");
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        (status, layout::error_page(status, &self.to_string())).into_response()
    }
}

/// A dashboard serving on its own address (`outbox dashboard`).
#[derive(Debug)]
pub struct RunningDashboard {
    addr: SocketAddr,
    shutdown: CancellationToken,
    task: JoinHandle<std::io::Result<()>>,
}

impl RunningDashboard {
    /// Binds `settings.listen` and serves the pages over `admin` until `shutdown` is
    /// cancelled.
    ///
    /// # Errors
    /// [`CliError::Invalid`] for a non-loopback address without a token,
    /// [`CliError::Listen`] when the address cannot be bound.
    pub async fn start(
        admin: Arc<dyn OutboxAdmin>,
        settings: &DashboardSettings,
        shutdown: CancellationToken,
    ) -> Result<Self, CliError> {
        settings.check_address(settings.listen)?;
        let listener = tokio::net::TcpListener::bind(settings.listen)
            .await
            .map_err(|source| CliError::Listen {
                addr: settings.listen,
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| CliError::Listen {
            addr: settings.listen,
            source,
        })?;
        let app = router(Dashboard::new(admin, settings, None));
        let token = shutdown.clone();
        let task = tokio::spawn(async move {
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .with_graceful_shutdown(token.cancelled_owned())
            .await
        });
        info!(
            url = %format!("http://{addr}/"),
            replay = settings.allow_replay,
            authentication = settings.token.is_some(),
            "dashboard listening"
        );
        Ok(Self {
            addr,
            shutdown,
            task,
        })
    }

    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops serving and waits for the server to finish.
    ///
    /// # Errors
    /// [`CliError::Task`] when the server failed or panicked.
    pub async fn stop(self) -> Result<(), CliError> {
        self.shutdown.cancel();
        self.wait().await
    }

    /// Waits until the server stops (its shutdown token cancelled).
    ///
    /// # Errors
    /// [`CliError::Task`] when the server failed or panicked.
    pub async fn wait(self) -> Result<(), CliError> {
        match self.task.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(CliError::Task(format!("dashboard server: {e}"))),
            Err(e) => Err(CliError::Task(e.to_string())),
        }
    }
}

/// `outbox dashboard`: connects, serves until SIGINT/SIGTERM.
pub(crate) async fn run(db: &DbSettings, settings: &DashboardSettings) -> Result<(), CliError> {
    let admin: Arc<dyn OutboxAdmin> = Arc::from(crate::database::connect_admin(db).await?);
    let shutdown = CancellationToken::new();
    let running = RunningDashboard::start(admin, settings, shutdown.clone()).await?;
    crate::relay::cancel_on_signal(shutdown).await;
    running.wait().await
}
